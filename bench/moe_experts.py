"""The experts of an MoE layer as one grouped matmul (at::_grouped_mm, what models/moe.cpp runs)
against a loop of one matmul per expert, forward and backward, at the shapes given. LibTorch's
kernels through PyTorch's Python API (the same ATen operators Tessel calls from C++).

  python3 bench/moe_experts.py [--rows 4096] [--experts 8] [--hidden 192] [--ffn 512] [--threads 2]

Prints a Markdown table (ms per call, median of --repeat runs after warm-up) for bench/RESULTS.md."""
import argparse
import statistics
import time

import torch


def timed(fn, repeat):
    for _ in range(3):
        fn()
    t = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(t)


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--rows", type=int, default=4096)
    a.add_argument("--experts", type=int, default=8)
    a.add_argument("--hidden", type=int, default=192)
    a.add_argument("--ffn", type=int, default=512)
    a.add_argument("--threads", type=int, default=2)
    a.add_argument("--repeat", type=int, default=20)
    args = a.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    e, h, f = args.experts, args.hidden, args.ffn
    # Uneven rows per expert, as a router leaves them (a multinomial draw), sorted by expert.
    counts = torch.multinomial(torch.ones(e), args.rows, replacement=True).bincount(minlength=e)
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(args.rows, h, requires_grad=True)
    w = torch.randn(e, f, h, requires_grad=True)
    g = torch.randn(args.rows, f)

    def grouped():
        return torch._grouped_mm(x, w.transpose(1, 2), offs=offs)

    def loop():
        return torch.cat([xs @ w[i].T for i, xs in enumerate(x.split(counts.tolist()))])

    assert torch.allclose(grouped(), loop(), rtol=1e-4, atol=1e-4)
    rows = []
    for name, fn in (("grouped (at::_grouped_mm)", grouped), ("loop of mm per expert", loop)):
        fwd = timed(lambda: fn().detach(), args.repeat)
        both = timed(lambda: torch.autograd.grad(fn(), (x, w), g), args.repeat)
        rows.append((name, fwd, both))
    print(f"{args.rows} rows over {e} experts, [{h}] -> [{f}], fp32, {args.threads} threads "
          f"(torch {torch.__version__})\n")
    print("| experts as | forward ms | forward + backward ms |\n|---|---|---|")
    for name, fwd, both in rows:
        print(f"| {name} | {fwd:.1f} | {both:.1f} |")


if __name__ == "__main__":
    main()
