"""Scaling on paper: DDP training throughput of ResNet-50 at 8, 64 and 512 GPUs, projected from one GPU's measured
speed and the time to all-reduce the gradients. A projection, not a measurement. Standard library only.

    python benchmarks/scaling.py --images-per-s-one-gpu 2470 --batch-per-gpu 256 --bandwidth 450 --bandwidth 25
    python benchmarks/scaling.py --images-per-s-one-gpu 2470 --batch-per-gpu 32 --bandwidth 25 --gpus 8 64 512 4096
    python benchmarks/scaling.py --check    # the model against published measurements, projected vs published

The model, all of it:
  gradient bytes  25.6e6 parameters x 4 bytes (ResNet-50; DDP keeps fp32 gradients under bf16 autocast too)
  compute         batch_per_gpu / images_per_s_one_gpu: one step on one GPU without DDP (forward, backward and
                  optimizer), the same on every GPU
  all-reduce      ring: 2(N-1)/N x bytes / bandwidth, bandwidth in GB/s (1e9 bytes/s) per GPU and per direction
                  on the ring's slowest link (NVLink within a node, InfiniBand across nodes)
  overlap         DDP all-reduces the gradients in buckets (25 MiB, its bucket_cap_mb default) while the backward
                  pass runs; backward = 2/3 of compute; the last bucket (min(25 MiB, bytes)) is ready only when
                  backward ends, so its all-reduce cannot overlap: overlappable = backward - allreduce(last bucket)
  step            compute + max(0, allreduce - overlappable)
  output          images/s per GPU = batch / step, total = N x that, efficiency = compute / step (vs one GPU
                  without DDP)
Not modelled: DDP's own per-step cost, per-bucket latency, the optimizer step as a cost of its own, the input
pipeline (data loading, JPEG decoding), stragglers, and topology (a node's GPUs sharing its network links).
"""
import argparse
import textwrap

PARAMS = 25.6e6          # ResNet-50
GRAD_BYTES = PARAMS * 4  # fp32 gradients
BUCKET_BYTES = 25 * 2**20
BACKWARD_SHARE = 2 / 3

# (name, images/s on one GPU without DDP, batch per GPU, GPUs, GB/s per GPU, published images/s per GPU on those
# GPUs, published speed-up over one GPU, where from and what is assumed)
REFERENCES = [
    ("PyTorch DDP benchmark, V100", 329, 32, 16, 12, 306, 16 * 306 / 329,
     "pytorch/pytorch, benchmarks/distributed/ddp/README.md: 329/s on one GPU without DDP, 306/s per GPU on 16 "
     "(2 machines x 8); with DDP already 319/s on one GPU and 307/s on one machine's 8; "
     "assumed: 12 GB/s per GPU between the machines (100 Gb/s EDR InfiniBand, shared)"),
    ("DeepLearningExamples, A100 TF32", 938, 256, 8, 300, 7248 / 8, 7.72,
     "NVIDIA DeepLearningExamples, PyTorch ResNet-50 v1.5, DGX A100: 938/s on one GPU, 7,248/s on 8 (7.72x); "
     "assumed: batch 256 per GPU, NVLink at 300 GB/s per direction"),
    ("DeepLearningExamples, A100 AMP", 2470, 256, 8, 300, 16621 / 8, 6.72,
     "the same table, mixed precision: 2,470/s on one GPU, 16,621/s on 8 (6.72x); the same assumptions"),
]


def ring_allreduce_s(nbytes, gpus, gb_per_s):
    return 2 * (gpus - 1) / gpus * nbytes / (gb_per_s * 1e9)


def project(images_per_s_one_gpu, batch_per_gpu, gpus, gb_per_s):
    """Returns (step seconds, images/s per GPU, efficiency vs one GPU without DDP)."""
    compute = batch_per_gpu / images_per_s_one_gpu
    allreduce = ring_allreduce_s(GRAD_BYTES, gpus, gb_per_s)
    last_bucket = ring_allreduce_s(min(BUCKET_BYTES, GRAD_BYTES), gpus, gb_per_s)
    overlappable = BACKWARD_SHARE * compute - last_bucket
    step = compute + max(0.0, allreduce - overlappable)
    return step, batch_per_gpu / step, compute / step


def print_table(a):
    compute = a.batch_per_gpu / a.images_per_s_one_gpu
    print(f"ResNet-50, {a.images_per_s_one_gpu:,.0f} images/s on one GPU, batch {a.batch_per_gpu} per GPU: compute "
          f"{compute * 1e3:.1f} ms per step, backward {BACKWARD_SHARE * compute * 1e3:.1f} ms;\n"
          f"gradients {GRAD_BYTES / 1e6:.1f} MB. Projection, not a measurement.")
    head, rule = ["GPUs"], ["---:"]
    for bw in a.bandwidth:
        head += [f"{bw:g} GB/s: all-reduce ms", "images/s per GPU", "total images/s", "efficiency"]
        rule += ["---:"] * 4
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(rule) + "|")
    for n in a.gpus:
        row = [str(n)]
        for bw in a.bandwidth:
            _, per_gpu, eff = project(a.images_per_s_one_gpu, a.batch_per_gpu, n, bw)
            row += [f"{ring_allreduce_s(GRAD_BYTES, n, bw) * 1e3:.1f}", f"{per_gpu:,.0f}", f"{n * per_gpu:,.0f}",
                    f"{eff:.1%}"]
        print("| " + " | ".join(row) + " |")


def print_check():
    print("The model against published measurements (projected vs published):")
    print("| reference | GPUs | GB/s | compute ms | all-reduce ms | images/s per GPU: projected | published "
          "| speed-up: projected | published | projected / published |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, one_gpu, batch, n, bw, published, speedup, _ in REFERENCES:
        _, per_gpu, _ = project(one_gpu, batch, n, bw)
        print(f"| {name} | {n} | {bw} | {batch / one_gpu * 1e3:.1f} | {ring_allreduce_s(GRAD_BYTES, n, bw) * 1e3:.1f} "
              f"| {per_gpu:,.0f} | {published:,.0f} | {n * per_gpu / one_gpu:.2f}x | {speedup:.2f}x "
              f"| {per_gpu / published - 1:+.1%} |")
    print("Sources and assumptions:")
    for name, *_, source in REFERENCES:
        print(textwrap.fill(f"{name}: {source}", 116, initial_indent="  ", subsequent_indent="    "))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images-per-s-one-gpu", type=float, default=2470,
                   help="measured throughput of one GPU without DDP, images/s (default 2470: DeepLearningExamples "
                        "ResNet-50 AMP on one A100)")
    p.add_argument("--batch-per-gpu", type=int, default=256, help="batch size per GPU (default 256)")
    p.add_argument("--bandwidth", type=float, action="append",
                   help="all-reduce bandwidth in GB/s per GPU and per direction; give it several times for one "
                        "column each (default 450: H100 NVLink)")
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 64, 512],
                   help="GPU counts, one row each (default 8 64 512)")
    p.add_argument("--check", action="store_true",
                   help="project the published reference points instead and print projected vs published")
    a = p.parse_args()
    if a.images_per_s_one_gpu <= 0 or a.batch_per_gpu <= 0 or min(a.gpus) < 1 or min(a.bandwidth or [1]) <= 0:
        p.error("--images-per-s-one-gpu, --batch-per-gpu, --gpus and --bandwidth must be positive")
    a.bandwidth = a.bandwidth or [450.0]
    if a.check:
        print_check()
    else:
        print_table(a)


if __name__ == "__main__":
    main()
