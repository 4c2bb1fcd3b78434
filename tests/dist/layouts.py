"""The parity table: every layout Tessel promises trains the same run as one process.

Each row is one ctest entry (parity.<id>, run by parity.py): the layout's run is compared with
the single-process run of the same plan (same global batch, same training keys, no parallel
keys, training.recompute, lean_logits and kernels at their defaults): loss within 1e-5 relative at every step, validation loss too when the base
evaluates, and every exported weight within 1e-5. Runs are cached by plan and binary, so rows
that share a reference train it once. Adding a layout is one line.

Row(id, base, arch, world, parallel keys, training keys, peak_below=(row id, factor), tol):
  base        one of BASES: the model, data and training of the experiment
  parallel    the plan's parallel section (dp, tp, cp, pp, zero, sequence_parallel,
              pipeline {schedule, virtual_stages, layers_per_stage}, context {method, alltoall_size})
  training    training keys of this row and of its reference (micro_batch, dtype, recompute...)
  peak_below  the step's peak memory must stay under factor x that row's ("reference": the
              single-process run's), for recompute; ZeRO-3's step peak is its gathered weights
              and gradient buckets at these sizes, hence 1.01 there
  tol         (loss relative, exported weights absolute; None: not compared): 1e-5 both at fp32;
              bf16/fp16 runs match one process in the same dtype up to low-precision summation
              order, so their losses within 2e-3 (weights drift apart in their low bits)
"""
from collections import namedtuple

Row = namedtuple("Row", "id base arch world parallel training peak_below tol",
                 defaults=({}, {}, None, (1e-5, 1e-5)))

# Steps of every base: 8 exercise every part of a layout. Warm-up ends at step 3 (2 for lowp and
# recompute), so steps 4-8 run the cosine decay (the LR schedule's change of slope) down to MIN_LR;
# every step is clipped (grad_clip 0.5, or the default 1.0 in the dp base, against measured norms
# of 1.1 to 4.0); fp16's loss scale grows at steps 4 and 8 (growth_interval 4); the pp and cp bases
# evaluate at steps 4 and 8; every run saves its last step, whose weights the rows compare; the
# resume tests continue a step-4 checkpoint. The DRIFT rows below train 20 steps (against 20-step
# references) to catch a difference that grows slowly, one row per family.
STEPS = 8
DRIFT = {"steps": 20}
# The cosine decay ends at MIN_LR, not 0: the last step's update reaches the exported weights.
MIN_LR = 3e-4

# training.fp8 rows: step 1 within FP8_FIRST_STEP (the same weights and scales: its forward
# differs from one process's only in fp32 summation order), every step within FP8_TOL's 2e-3.
# fp8 rounds to steps of 2^-3 (e4m3) and 2^-2 (e5m2) of a value: an fp32 difference of a layout's
# summation order (1e-7 relative) moves a few of a step's elements across a rounding boundary, each
# by a whole step, and Adam carries that on (measured up to 8.6e-4 over these 8 steps, 2026-11-30;
# a pipeline, which splits no sum, is bitwise); the weights drift apart likewise (not compared).
# Each split layer's scales are held exactly by tessel-dist-tests' Fp8Layers (1e-6 of one device).
FP8_TOL = (2e-3, None)
FP8_FIRST_STEP = 1e-6

# Each base: the plan's sections over tests/reference/plans.py's base_plan, and its token data.
BASES = {
    "dp": {"data": {"n": 6000, "vocab": 300, "period": 37},
           "training": {"steps": STEPS, "global_batch": 8, "optimizer": {"lr": 3e-3}, "schedule": {"warmup_steps": 3, "min_lr": MIN_LR}}},
    "tp": {"data": {"n": 6000, "vocab": 301, "period": 41}, "model": {"vocab_size": 301},
           "training": {"steps": STEPS, "global_batch": 8, "micro_batch": 2, "optimizer": {"lr": 3e-3},
                        "schedule": {"warmup_steps": 3, "min_lr": MIN_LR}, "grad_clip": 0.5}},
    "pp": {"data": {"n": 6000, "vocab": 301, "period": 41, "val_fraction": 0.1}, "model": {"vocab_size": 301, "layers": 8},
           "training": {"steps": STEPS, "global_batch": 8, "micro_batch": 1, "optimizer": {"lr": 3e-3},
                        "schedule": {"warmup_steps": 3, "min_lr": MIN_LR}, "grad_clip": 0.5, "eval_every": 4, "eval_batches": 1}},
    "cp": {"data": {"n": 12000, "vocab": 301, "period": 41, "val_fraction": 0.1}, "model": {"vocab_size": 301, "layers": 4},
           "training": {"steps": STEPS, "global_batch": 8, "micro_batch": 1, "seq_len": 32, "optimizer": {"lr": 3e-3},
                        "schedule": {"warmup_steps": 3, "min_lr": MIN_LR}, "grad_clip": 0.5, "eval_every": 4, "eval_batches": 1}},
    "zero": {"data": {"n": 6000, "vocab": 301, "period": 41}, "model": {"vocab_size": 301, "layers": 4},
             "training": {"steps": STEPS, "global_batch": 8, "micro_batch": 1, "optimizer": {"lr": 3e-3},
                          "schedule": {"warmup_steps": 3, "min_lr": MIN_LR}, "grad_clip": 0.5},
             "parallel": {"ddp": {"bucket_mb": 0.02}}},
    "lowp": {"data": {"n": 20000, "vocab": 300, "period": 41},
             "training": {"steps": STEPS, "global_batch": 4, "micro_batch": 2, "optimizer": {"lr": 3e-3},
                          "schedule": {"warmup_steps": 2, "min_lr": MIN_LR}, "grad_clip": 1.0,
                          "loss_scale": {"initial": 1024.0, "growth_interval": 4}}},
    "recompute": {"data": {"n": 6000, "vocab": 300, "period": 41}, "model": {"layers": 4, "max_seq_len": 64},
                  "training": {"steps": 8, "global_batch": 8, "micro_batch": 2, "seq_len": 64, "optimizer": {"lr": 3e-3},
                               "schedule": {"warmup_steps": 2, "min_lr": MIN_LR}, "grad_clip": 0.5}},
    # model.mlp relu2: the squared-ReLU MLP, neither architecture's own form (tp's data and training)
    "relu2": {"data": {"n": 6000, "vocab": 301, "period": 41}, "model": {"vocab_size": 301, "mlp": "relu2"},
              "training": {"steps": STEPS, "global_batch": 8, "micro_batch": 2, "optimizer": {"lr": 3e-3},
                           "schedule": {"warmup_steps": 3, "min_lr": MIN_LR}, "grad_clip": 0.5}},
    # mixture of experts (llama): 4 layers, the 2nd and 4th MoE (every 2) or all of them
    **{name: {"data": {"n": 6000, "vocab": 301, "period": 41}, "model": {"vocab_size": 301, "layers": 4, "moe": moe},
              "training": {"steps": STEPS, "global_batch": 8, "micro_batch": 1, "optimizer": {"lr": 3e-3},
                           "schedule": {"warmup_steps": 3, "min_lr": MIN_LR}, "grad_clip": 0.5}}
       for name, moe in (("moe", {"experts": 4, "top_k": 2, "ffn_hidden": 32}),
                         ("moe_shared", {"experts": 8, "top_k": 2, "ffn_hidden": 16, "shared_experts": 1,
                                         "every": 2}),
                         ("moe_capacity", {"experts": 4, "top_k": 2, "ffn_hidden": 32, "capacity_factor": 1.0}),
                         ("moe_sigmoid", {"experts": 4, "top_k": 2, "ffn_hidden": 32,
                                          "router": {"score": "sigmoid"}}),
                         ("moe_bias", {"experts": 4, "top_k": 2, "ffn_hidden": 32, "router": {"score": "sigmoid"},
                                       "aux_loss_coef": 0.0, "bias_update_rate": 0.01}))},
    # document masking: one document ends after 1 token in 8 (data.eod_token 300), evaluated
    **{name: {"data": {"n": 8000, "vocab": 301, "period": 41, "eod": 300, "val_fraction": 0.1},
              "model": {"vocab_size": 301, "layers": 4, **model},
              "training": {"steps": STEPS, "global_batch": 8, "micro_batch": 1, "seq_len": 32,
                           "optimizer": {"lr": 3e-3}, "schedule": {"warmup_steps": 3, "min_lr": MIN_LR},
                           "grad_clip": 0.5, "eval_every": 4, "eval_batches": 1}}
       for name, model in (("docmask", {}), ("docmask_moe", {"moe": {"experts": 4, "top_k": 2, "ffn_hidden": 32}}))},
    # the same data with no loss on the token after each end of document as well (data.eod_mask_loss,
    # Megatron's --eod-mask-loss: about one target in eight unscored, a different count per
    # micro-batch), evaluated
    # training.fp8: dimensions multiples of 16 on every rank, as CUDA's float8 matmuls take them
    # (hidden 64, heads of 16, ffn 128; 32 tokens a micro-batch, 16 per cp rank); fp8_gpt2: GPT-2's
    # (no grouped-query attention; biases); fp8_moe: four experts in every second layer (the
    # experts stay fp32)
    **{name: {"data": {"n": 12000, "vocab": 301, "period": 41},
              "model": {"vocab_size": 301, "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2,
                        "ffn_hidden": 128, **model},
              "training": {"steps": STEPS, "global_batch": 8, "micro_batch": 1, "seq_len": 32,
                           "optimizer": {"lr": 3e-3}, "schedule": {"warmup_steps": 3, "min_lr": MIN_LR},
                           "grad_clip": 0.5}}
       for name, model in (("fp8", {}), ("fp8_gpt2", {"kv_heads": 4}),
                           ("fp8_moe", {"moe": {"experts": 4, "top_k": 2, "ffn_hidden": 32, "every": 2}}))},
    "eodmask": {"data": {"n": 8000, "vocab": 301, "period": 41, "eod": 300, "val_fraction": 0.1, "mask_loss": True},
                "model": {"vocab_size": 301, "layers": 4},
                "training": {"steps": STEPS, "global_batch": 8, "micro_batch": 1, "seq_len": 32,
                             "optimizer": {"lr": 3e-3}, "schedule": {"warmup_steps": 3, "min_lr": MIN_LR},
                             "grad_clip": 0.5, "eval_every": 4, "eval_batches": 1}},
}

SP = {"sequence_parallel": True}


def pipe(pp, schedule, v=1, **more):
    return {"pp": pp, "pipeline": {"schedule": schedule, "virtual_stages": v}, **more}


LAYOUTS = [
    # data parallel, with and without gradient accumulation
    Row("dp2_gpt2", "dp", "gpt2", 2, {"dp": 2}, {"micro_batch": 4}),
    Row("dp2_accumulate_llama", "dp", "llama", 2, {"dp": 2}, {"micro_batch": 1}),
    Row("dp4_llama", "dp", "llama", 4, {"dp": 4}, {"micro_batch": 2}),
    Row("dp4_accumulate_gpt2", "dp", "gpt2", 4, {"dp": 4}, {"micro_batch": 1}),
    # tensor parallel (vocabulary 301: not divisible by tp; llama kv_heads 2: tp=4 replicates them)
    *[Row(f"tp{tp}_dp{dp}{'_sp' if sp else ''}_{arch}", "tp", arch, tp * dp, {"tp": tp, "sequence_parallel": sp})
      for arch in ("gpt2", "llama") for tp, dp, sp in
      ((2, 1, False), (2, 1, True), (4, 1, False), (4, 1, True), (2, 2, False), (2, 2, True))],
    # pipeline parallel: every schedule, interleaved chunks, 3D, uneven stages
    *[Row(f"pp{pp}_{s}_v{v}_{arch}", "pp", arch, pp, pipe(pp, s, v)) for arch in ("gpt2", "llama")
      for pp, s, v in ((2, "gpipe", 1), (2, "1f1b", 1), (4, "gpipe", 1), (4, "1f1b", 1),
                       (2, "interleaved", 2), (4, "interleaved", 2), (2, "zb-h1", 1), (4, "zb-h1", 1),
                       (2, "zbv", 2), (4, "zbv", 2))],
    # zero-bubble inside 3D and with recomputation (B reruns the block, W waits for it)
    Row("pp2_zbv_tp2_dp2_sp_gpt2", "pp", "gpt2", 8, pipe(2, "zbv", 2, tp=2, dp=2, **SP)),
    Row("pp2_zb-h1_tp2_dp2_sp_llama", "pp", "llama", 8, pipe(2, "zb-h1", tp=2, dp=2, **SP)),
    *[Row(f"pp2_{s}_recompute_{mode}_llama", "pp", "llama", 2, pipe(2, s, v), {"recompute": mode})
      for s, v in (("zb-h1", 1), ("zbv", 2)) for mode in ("selective", "full")],
    Row("pp2_1f1b_tp2_dp2_gpt2", "pp", "gpt2", 8, pipe(2, "1f1b", tp=2, dp=2)),
    Row("pp2_1f1b_tp2_dp2_llama", "pp", "llama", 8, pipe(2, "1f1b", tp=2, dp=2)),
    Row("pp2_interleaved_tp2_dp2_sp_gpt2", "pp", "gpt2", 8, pipe(2, "interleaved", 2, tp=2, dp=2, **SP)),
    Row("pp2_interleaved_tp2_dp2_sp_llama", "pp", "llama", 8, pipe(2, "interleaved", 2, tp=2, dp=2, **SP)),
    Row("pp2_interleaved_uneven_3221_llama", "pp", "llama", 2,
        {"pp": 2, "pipeline": {"schedule": "interleaved", "virtual_stages": 2, "layers_per_stage": [3, 2, 2, 1]}}),
    # context parallel: both methods, and in 4D
    *[Row(f"cp{cp}_{m}_{arch}", "cp", arch, cp, {"cp": cp, "context": {"method": m}})
      for arch in ("gpt2", "llama") for cp in (2, 4) for m in ("allgather", "ring", "alltoall")],
    *[Row(f"cp2_tp2_pp2_sp_{m}_llama", "cp", "llama", 8, {"cp": 2, "tp": 2, "pp": 2, "context": {"method": m}, **SP})
      for m in ("allgather", "ring", "alltoall")],
    *[Row(f"dp2_cp2_zero1_{m}_llama", "cp", "llama", 4, {"cp": 2, "dp": 2, "zero": 1, "context": {"method": m}})
      for m in ("allgather", "ring", "alltoall")],
    # alltoall on grouped-query llama (kv_heads 2): tp2 x cp2 (one query and one key/value head
    # per tp rank, the key/value head repeated to split over cp), and with full recomputation
    Row("tp2_cp2_alltoall_llama", "cp", "llama", 4, {"cp": 2, "tp": 2, "context": {"method": "alltoall"}}),
    Row("cp2_alltoall_recompute_full_llama", "cp", "llama", 2, {"cp": 2, "context": {"method": "alltoall"}},
        {"recompute": "full"}),
    # hybrid: all-to-all inside pairs of cp ranks, ring across the pairs; and cp inside 3D
    *[Row(f"cp4_hybrid2_{arch}", "cp", arch, 4, {"cp": 4, "context": {"method": "hybrid", "alltoall_size": 2}})
      for arch in ("gpt2", "llama")],
    Row("dp2_pp2_cp2_alltoall_llama", "cp", "llama", 8, {"cp": 2, "dp": 2, "pp": 2, "context": {"method": "alltoall"}}),
    # ZeRO 1-3 over 2 and 4 data ranks, and inside 3D layouts
    *[Row(f"zero{z}_dp{dp}_{arch}", "zero", arch, dp, {"dp": dp, "zero": z})
      for arch in ("gpt2", "llama") for dp in (2, 4) for z in (1, 2, 3)],
    *[Row(f"zero1_dp2_tp2_pp2_interleaved_sp_{arch}", "zero", arch, 8,
          pipe(2, "interleaved", 2, tp=2, dp=2, zero=1, **SP)) for arch in ("gpt2", "llama")],
    Row("zero3_dp2_tp2_llama", "zero", "llama", 4, {"dp": 2, "tp": 2, "zero": 3}),
    # ZeRO-2 inside pipelines: reduce-scattered once per step at each chunk's last backward
    *[Row(f"zero2_dp2_pp2_{s}_{arch}", "zero", arch, 4, pipe(2, s, v, dp=2, zero=2))
      for arch in ("gpt2", "llama") for s, v in (("1f1b", 1), ("interleaved", 2), ("zbv", 2))],
    *[Row(f"zero1_dp2_pp2_{s}_{arch}", "zero", arch, 4, pipe(2, s, v, dp=2, zero=1))
      for arch in ("gpt2", "llama") for s, v in (("zb-h1", 1), ("zbv", 2))],
    # ZeRO-3 inside pipelines: units gathered per use and freed (lean) or kept for the step (fast)
    *[Row(f"zero3_dp2_pp2_{s}_{'keep' if keep else 'free'}_{arch}", "zero", arch, 4,
          pipe(2, s, v, dp=2, zero=3, zero3={"keep_gathered": keep}))
      for arch, s, v, keep in (("gpt2", "1f1b", 1, False), ("gpt2", "1f1b", 1, True),
                               ("llama", "1f1b", 1, False), ("llama", "1f1b", 1, True),
                               ("llama", "interleaved", 2, False), ("gpt2", "zb-h1", 1, True),
                               ("gpt2", "zbv", 2, False), ("llama", "zbv", 2, True))],
    Row("zero3_dp2_pp2_1f1b_free_bf16_llama", "zero", "llama", 4, pipe(2, "1f1b", dp=2, zero=3), {"dtype": "bf16"},
        None, (2e-3, None)),
    Row("zero3_dp2_pp2_1f1b_keep_bf16_gpt2", "zero", "gpt2", 4,
        pipe(2, "1f1b", dp=2, zero=3, zero3={"keep_gathered": True}), {"dtype": "bf16"}, None, (2e-3, None)),
    # bf16 ZeRO-2 in a V: the tied table's two gradients (head and embedding, one rank) each
    # reduce-scattered as they come, per micro-batch
    Row("zero2_dp2_pp2_zbv_bf16_gpt2", "zero", "gpt2", 4, pipe(2, "zbv", 2, dp=2, zero=2), {"dtype": "bf16"},
        None, (2e-3, None)),
    # hybrid sharding (parallel.zero_shard): ZeRO inside groups of 2 data ranks, the pieces summed
    # across the groups; ZeRO-3, ZeRO-1 in a pipeline (the tied table on two stages), ZeRO-2 with
    # the experts (sharded over 1 rank, replicated over 2), and bf16 ZeRO-1 (its folded gradients)
    Row("zero3_dp4_shard2_llama", "zero", "llama", 4, {"dp": 4, "zero": 3, "zero_shard": 2}),
    Row("zero1_dp4_shard2_pp2_1f1b_gpt2", "zero", "gpt2", 8, pipe(2, "1f1b", dp=4, zero=1, zero_shard=2)),
    Row("moe_zero2_ep2_dp4_shard2_llama", "moe", "llama", 4, {"dp": 4, "ep": 2, "zero": 2, "zero_shard": 2}),
    Row("zero1_dp4_shard2_bf16_gpt2", "lowp", "gpt2", 4, {"dp": 4, "zero": 1, "zero_shard": 2}, {"dtype": "bf16", "micro_batch": 1},
        None, (2e-3, None)),
    # ... in a V (bf16 ZeRO-2: the tied table, filled from two chunks of rank 0, summed over the
    # replicas after backward, every other bucket as it completes)
    Row("zero2_dp4_shard2_pp2_zbv_bf16_gpt2", "zero", "gpt2", 8, pipe(2, "zbv", 2, dp=4, zero=2, zero_shard=2),
        {"dtype": "bf16"}, None, (2e-3, None)),
    # ... with cp (a shard group is one data rank's two cp ranks) and with tp + sp
    Row("zero2_dp2_cp2_shard2_alltoall_llama", "cp", "llama", 4,
        {"cp": 2, "dp": 2, "zero": 2, "zero_shard": 2, "context": {"method": "alltoall"}}),
    Row("zero1_dp4_tp2_sp_shard2_llama", "zero", "llama", 8, {"dp": 4, "tp": 2, "zero": 1, "zero_shard": 2, **SP}),
    # bf16/fp16 weights with fp32 masters sharded (ZeRO-1) or everything sharded (ZeRO-3)
    *[Row(f"zero{z}_dp2_{dtype}_gpt2", "lowp", "gpt2", 2, {"dp": 2, "zero": z}, {"dtype": dtype}, None, (2e-3, None))
      for dtype in ("bf16", "fp16") for z in (1, 3)],
    # activation recomputation: the same run, and less memory than the same layout without it
    *[Row(f"recompute_{name}_{mode}_{arch}", "recompute", arch, world, par, {"recompute": mode},
          (f"recompute_{name}_none_{arch}" if name != "single" else "reference",
           most if name != "zero3" else 1.01) if mode != "none" else None)
      for name, arch, par, world in (("single", "llama", {}, 1), ("single", "gpt2", {}, 1),
                                     ("tp2_sp", "llama", {"tp": 2, **SP}, 2),
                                     ("pp2", "gpt2", pipe(2, "1f1b"), 2),
                                     ("zero3", "llama", {"dp": 2, "zero": 3}, 2))
      for mode, most in (("none", None), ("selective", 0.9), ("full", 0.7))
      if not (name == "single" and mode == "none")],
    # mixture of experts with expert parallelism (ep ranks drawn from dp), dropless unless
    # capacity_factor (then the same choices dropped as one process: per sequence, in token order)
    Row("moe_dp2_llama", "moe", "llama", 2, {"dp": 2}),
    Row("moe_ep2_llama", "moe", "llama", 2, {"dp": 2, "ep": 2}),
    Row("moe_ep2_dp2_llama", "moe", "llama", 4, {"dp": 4, "ep": 2}),
    Row("moe_ep4_top2_shared_llama", "moe_shared", "llama", 4, {"dp": 4, "ep": 4}),
    Row("moe_ep2_tp2_llama", "moe", "llama", 4, {"dp": 2, "ep": 2, "tp": 2}),
    Row("moe_ep2_tp2_sp_llama", "moe", "llama", 4, {"dp": 2, "ep": 2, "tp": 2, **SP}),
    Row("moe_ep2_pp2_llama", "moe", "llama", 4, pipe(2, "1f1b", dp=2, ep=2)),
    Row("moe_ep2_pp2_zbv_llama", "moe", "llama", 4, pipe(2, "zbv", 2, dp=2, ep=2)),
    Row("moe_ep2_cp2_llama", "moe", "llama", 4, {"dp": 2, "ep": 2, "cp": 2}),
    Row("moe_ep2_dp2_capacity_llama", "moe_capacity", "llama", 4, {"dp": 4, "ep": 2}),
    Row("moe_ep2_sigmoid_llama", "moe_sigmoid", "llama", 2, {"dp": 2, "ep": 2}),
    # auxiliary-loss-free balancing (DeepSeek-V3's bias of expert choice, moved after each step)
    Row("moe_bias_ep2_dp2_llama", "moe_bias", "llama", 4, {"dp": 4, "ep": 2}),
    Row("moe_bias_zero3_ep2_pp2_llama", "moe_bias", "llama", 4, pipe(2, "1f1b", dp=2, ep=2, zero=3)),
    *[Row(f"moe_ep2_recompute_{mode}_llama", "moe", "llama", 2, {"dp": 2, "ep": 2}, {"recompute": mode})
      for mode in ("selective", "full")],
    Row("moe_zero1_dp2_llama", "moe", "llama", 2, {"dp": 2, "zero": 1}),
    # three data ranks: an odd shard count, which left later flat-buffer slots unaligned before
    # every slot, bucket and piece started on 64 elements (CUDA's grouped matmul needs 16 bytes)
    *[Row(f"moe_zero{z}_dp3_llama", "moe", "llama", 3, {"dp": 3, "zero": z}, {"global_batch": 6}) for z in (1, 2)],
    # ZeRO with expert parallelism: the experts' state split over the ranks holding the same
    # experts (dp/ep of them), the rest over the data group
    *[Row(f"moe_zero{z}_ep2_dp2_llama", "moe", "llama", 4, {"dp": 4, "ep": 2, "zero": z}) for z in (1, 2, 3)],
    Row("moe_zero3_ep2_llama", "moe", "llama", 2, {"dp": 2, "ep": 2, "zero": 3}),
    Row("moe_zero2_ep2_pp2_llama", "moe", "llama", 4, pipe(2, "1f1b", dp=2, ep=2, zero=2)),
    Row("moe_ep2_bf16_llama", "moe", "llama", 2, {"dp": 2, "ep": 2}, {"dtype": "bf16"}, None, (2e-3, None)),
    Row("moe_ep2_fp16_llama", "moe", "llama", 2, {"dp": 2, "ep": 2},
        {"dtype": "fp16", "loss_scale": {"initial": 1024.0, "growth_interval": 4}}, None, (2e-3, None)),
    # lean logits (the head fused with the loss, in chunks) and LibTorch's kernels against the
    # defaults the reference runs (lean, one chunk at these sizes; Tessel's GELU, SwiGLU, RMSNorm,
    # RoPE and short-sequence attention)
    *[Row(f"unfused_logits_{arch}", "dp", arch, 1, {}, {"lean_logits": False}) for arch in ("gpt2", "llama")],
    *[Row(f"torch_kernels_{arch}", "dp", arch, 1, {}, {"kernels": "torch"}) for arch in ("gpt2", "llama")],
    *[Row(f"lean_chunk24_tp2_sp_{arch}", "tp", arch, 2, {"tp": 2, **SP}, {"lean_logits_chunk": 24})
      for arch in ("gpt2", "llama")],
    # document masking (data.document_mask) through every parallelism: attention inside each
    # document and positions restarted (RoPE and learned), against one process with the mask
    *[Row(f"docmask_{name}_{arch}", "docmask", arch, world, par, train)
      for name, arch, world, par, train in (
          ("dp2", "gpt2", 2, {"dp": 2}, {}), ("tp2_sp", "gpt2", 2, {"tp": 2, **SP}, {}),
          ("tp2_sp", "llama", 2, {"tp": 2, **SP}, {}), ("pp2_1f1b", "llama", 2, pipe(2, "1f1b"), {}),
          ("pp2_zbv", "gpt2", 2, pipe(2, "zbv", 2), {}), ("zero3_dp2", "llama", 2, {"dp": 2, "zero": 3}, {}),
          ("recompute_full", "llama", 1, {}, {"recompute": "full"}),
          ("cp2_alltoall", "llama", 2, {"cp": 2, "context": {"method": "alltoall"}}, {}),
          ("cp2_alltoall", "gpt2", 2, {"cp": 2, "context": {"method": "alltoall"}}, {}),
          ("dp2_pp2_cp2_alltoall", "llama", 8, {"cp": 2, "dp": 2, "pp": 2, "context": {"method": "alltoall"}}, {}))],
    Row("docmask_moe_ep2_llama", "docmask_moe", "llama", 2, {"dp": 2, "ep": 2}),
    # data.eod_mask_loss: the mean over the global batch's scored targets in every layout (the
    # weighted loss through the vocabulary-parallel and the fused lean-logits paths)
    *[Row(f"eodmask_{name}_{arch}", "eodmask", arch, world, par, train)
      for name, arch, world, par, train in (
          ("dp2", "gpt2", 2, {"dp": 2}, {}), ("tp2_sp", "llama", 2, {"tp": 2, **SP}, {}),
          ("pp2_1f1b", "llama", 2, pipe(2, "1f1b"), {}),
          # (llama: on GPT-2 with this data one element of the token table's gradient cancels to
          # 1e-9 at step 1, where Adam turns any other summation order's rounding into 4% of an
          # update: 4.4e-5 in the exported weights under cp, 4.8e-5 with unfused logits; the
          # losses stay within 3e-7)
          ("cp2_alltoall", "llama", 2, {"cp": 2, "context": {"method": "alltoall"}}, {}),
          ("unfused_logits", "llama", 1, {}, {"lean_logits": False}))],
    # the squared-ReLU MLP (model.mlp relu2) split by tensor parallelism and by a pipeline; its
    # planner figures come from its form alone (models/mlp_relu2.cpp)
    Row("relu2_tp2_sp_gpt2", "relu2", "gpt2", 2, {"tp": 2, **SP}),
    Row("relu2_pp2_1f1b_gpt2", "relu2", "gpt2", 2, pipe(2, "1f1b")),
    # training.fp8 (core/kernels/fp8.h) against one process in fp8: every amax completed over the
    # ranks that split its tensor, so the scales are the single process's (FP8_TOL)
    *[Row(f"fp8_{recipe}_{name}_{arch}", base, arch, world, par, {"fp8": recipe}, tol=FP8_TOL)
      for recipe, name, base, arch, world, par in (
          ("tensorwise", "tp2_sp", "fp8", "llama", 2, {"tp": 2, **SP}),
          ("tensorwise", "tp2", "fp8_gpt2", "gpt2", 2, {"tp": 2}),
          ("tensorwise", "zero1_dp2", "fp8", "llama", 2, {"dp": 2, "zero": 1}),
          ("tensorwise", "zero3_dp2", "fp8", "llama", 2, {"dp": 2, "zero": 3}),
          ("tensorwise", "pp2_1f1b", "fp8", "llama", 2, pipe(2, "1f1b")),
          ("tensorwise", "cp2_ring", "fp8", "llama", 2, {"cp": 2, "context": {"method": "ring"}}),
          ("tensorwise", "moe_ep2_dp2", "fp8_moe", "llama", 2, {"dp": 2, "ep": 2}),
          ("rowwise", "tp2_sp", "fp8", "llama", 2, {"tp": 2, **SP}),
          ("rowwise", "cp2_ring", "fp8", "llama", 2, {"cp": 2, "context": {"method": "ring"}}),
          ("rowwise", "pp2_zbv", "fp8", "llama", 2, pipe(2, "zbv", 2)))],
    # one process on two threads: four micro-batches run two at a time (training.microbatch_pairs)
    # against the reference's one at a time on one thread
    *[Row(f"microbatch_pairs_{arch}", "dp", arch, 1, {}, {"threads": 2}) for arch in ("gpt2", "llama")],
]

# The drift rows: one per family, at 20 steps against 20-step references (see STEPS).
DRIFT_ROWS = ("dp4_accumulate_gpt2", "tp2_dp2_sp_llama", "pp4_interleaved_v2_llama", "cp4_hybrid2_llama",
              "zero3_dp4_gpt2", "zero1_dp2_bf16_gpt2", "moe_ep2_dp2_llama")
LAYOUTS = [r._replace(training={**r.training, **DRIFT}) if r.id in DRIFT_ROWS else r for r in LAYOUTS]

# `make check`'s rows: one per parallelism (dp, tp+sp, pp 1F1B, cp ring, ZeRO-3, ep).
CHECK_ROWS = ("dp2_gpt2", "tp2_dp1_sp_llama", "pp2_1f1b_v1_gpt2", "cp2_ring_llama", "zero3_dp2_llama",
              "moe_ep2_llama")

BY_ID = {r.id: r for r in LAYOUTS}
assert all(r in BY_ID for r in DRIFT_ROWS + CHECK_ROWS), "drift and check rows must be rows of the table"
assert len(BY_ID) == len(LAYOUTS), "row ids must be unique"



def processors(row):
    """ctest's PROCESSORS for the row: 1, so that two rows run side by side on the CI machine's 2
    cores. A row's ranks spend most of their time starting LibTorch, meeting at the rendezvous and
    waiting for each other at these sizes: 16 rows of the table took 77.8 s one at a time and
    57.6 s two at a time (2026-11-27, cold caches both). A single process computing on 2 threads
    keeps both cores busy: 2."""
    return 2 if row.world == 1 and row.training.get("threads", 1) > 1 else 1


if __name__ == "__main__":  # for CMake: one ctest entry per row, "id:processors:tier:world"
    print(";".join(f"{r.id}:{processors(r)}:{'check' if r.id in CHECK_ROWS else 'full'}:{r.world}" for r in LAYOUTS))
