#include <gtest/gtest.h>

#include <map>
#include <set>

#include "core/optim/flat_layout.h"

namespace tessel::optim {
namespace {

std::vector<ParamEntry> toy() {  // reverse registration order, as layout_of gives it
  return {{"head.weight", 10, 0},
          {"norm.weight", 3, 0},
          {"layers.1.mlp.up.weight", 7, 0},
          {"layers.1.attn.q.weight", 5, 0},
          {"layers.0.mlp.up.weight", 7, 0},
          {"layers.0.attn.q.weight", 5, 0},
          {"embed.weight", 9, 0}};
}

// Every element of every parameter is held by exactly one shard rank, once, and the pieces of a
// rank tile its shard buffer without gaps.
void expect_partition(const std::vector<ParamEntry>& params, LayoutOptions o) {
  std::map<std::string, std::vector<int>> owners;
  for (const auto& p : params) owners[p.name].assign(static_cast<size_t>(p.numel), 0);
  for (int64_t r = 0; r < o.shards; ++r) {
    o.shard_rank = r;
    FlatLayout layout(params, o);
    std::vector<int> shard(static_cast<size_t>(layout.shard_numel()), 0);
    for (const auto& b : layout.buckets()) {
      EXPECT_EQ((b.end - b.begin) % (o.shards * kAlignElements), 0);
      EXPECT_EQ(b.begin % kAlignElements, 0);
      EXPECT_EQ(b.shard_offset % kAlignElements, 0);
    }
    for (const auto& s : layout.slots()) {
      EXPECT_EQ(s.offset % kAlignElements, 0) << s.name;
      for (const auto& piece : layout.pieces(s)) {
        EXPECT_EQ(piece.flat, s.offset + piece.param_offset);
        EXPECT_EQ(piece.flat % kAlignElements, 0) << s.name;
        EXPECT_EQ(piece.shard % kAlignElements, 0) << s.name;
        for (int64_t i = 0; i < piece.numel; ++i) {
          ++owners[s.name][static_cast<size_t>(piece.param_offset + i)];
          ++shard[static_cast<size_t>(piece.shard + i)];
        }
      }
    }
    for (int c : shard) EXPECT_LE(c, 1);  // padding is the only thing held by no parameter
  }
  for (const auto& [name, counts] : owners)
    for (int c : counts) EXPECT_EQ(c, 1) << name;
}

TEST(FlatLayout, BucketsCappedPaddedAndPartitioned) {
  // Each of the 7 parameters starts on a multiple of 64 elements; the bucket ends on one.
  FlatLayout one(toy(), {1000, 1, 0, plan::Sharding::of(0), false});
  EXPECT_EQ(one.buckets().size(), 1u);
  EXPECT_EQ(one.numel(), 448);
  EXPECT_EQ(one.shard_numel(), 448);
  EXPECT_EQ(one.slot("embed.weight").offset, 384);
  FlatLayout capped(toy(), {12, 4, 1, plan::Sharding::of(1), false});
  // A bucket closes once it holds >= 12 elements: [head norm] [l1.up l1.q] [l0.up l0.q] [embed]
  ASSERT_EQ(capped.buckets().size(), 4u);
  EXPECT_EQ(capped.buckets()[0].end, 256);  // 64 + 3 padded to 4 pieces of 64
  EXPECT_EQ(capped.slot("layers.1.mlp.up.weight").offset, 256);
  EXPECT_EQ(capped.shard_numel(), capped.numel() / 4);
  for (int64_t shards : {1, 2, 3, 4, 8})
    for (int64_t zero : {1, 3})
      expect_partition(toy(), {12, shards, 0, plan::Sharding::of(zero), false});
  for (int64_t shards : {3, 6})
    expect_partition(toy(), {1000, shards, 0, plan::Sharding::of(2), false});
}

TEST(FlatLayout, Zero3BucketsAreUnitsAndChunksNeverMix) {
  FlatLayout z3(toy(), {4, 2, 0, plan::Sharding::of(3), false});
  std::vector<std::string> units;
  for (const auto& b : z3.buckets()) units.push_back(b.unit);
  EXPECT_EQ(units, (std::vector<std::string>{"root", "layers.1", "layers.0", "root"}));
  EXPECT_EQ(unit_of("layers.12.attn.q.weight"), "layers.12");
  EXPECT_EQ(unit_of("norm.weight"), "root");
  // Chunks 1 and 0 alternate in the entry order, and the bucket cap (1000) would hold them all:
  // every bucket must still hold one chunk's parameters only (a bucket is reduced when its chunk's
  // backward is done), and the tied embedding a bucket of its own.
  auto chunked = toy();
  const std::map<std::string, int64_t> chunk_of = {{"head.weight", 1},
                                                   {"norm.weight", 1},
                                                   {"layers.1.mlp.up.weight", 0},
                                                   {"layers.1.attn.q.weight", 1},
                                                   {"layers.0.mlp.up.weight", 0},
                                                   {"layers.0.attn.q.weight", 0},
                                                   {"embed.weight", 0}};
  for (auto& e : chunked) e.chunk = chunk_of.at(e.name);
  FlatLayout pp(chunked, {1000, 2, 0, plan::Sharding::of(1), true});
  std::set<std::pair<int64_t, int64_t>> bucket_chunks;  // (bucket, chunk) pairs seen
  for (const auto& s : pp.slots()) {
    bucket_chunks.insert({s.bucket, chunk_of.at(s.name)});
    EXPECT_EQ(pp.buckets()[static_cast<size_t>(s.bucket)].chunk, chunk_of.at(s.name)) << s.name;
    for (const auto& t : pp.slots())
      if (s.bucket == t.bucket) {
        EXPECT_EQ(chunk_of.at(s.name), chunk_of.at(t.name)) << s.name << " and " << t.name;
        EXPECT_EQ(s.name == "embed.weight", t.name == "embed.weight")
            << s.name << " and " << t.name;
      }
  }
  std::set<int64_t> buckets;
  for (const auto& [b, c] : bucket_chunks) EXPECT_TRUE(buckets.insert(b).second) << "bucket " << b;
  EXPECT_GE(pp.buckets().size(), 4u);  // chunk runs 1 | 0 | 1 | 0 (embedding alone)
  EXPECT_THROW(pp.slot("nope"), std::out_of_range);
}

}  // namespace
}  // namespace tessel::optim
