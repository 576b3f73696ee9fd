"""What a save costs each rank: the time it is blocked in the script's own save() and the rise of its resident
memory meanwhile, for --ckpt-format file (last.pt, gathered whole to rank 0), dcp (every rank writes its part) and
dcp --async-save (every rank copies its part to host memory and writes it in a thread).

    torchrun --nproc_per_node=2 benchmarks/checkpoint.py                        # fsdp_train.py, resnet50, AdamW
    torchrun --nproc_per_node=2 benchmarks/checkpoint.py --script ddp_launch_train.py --json ckpt.json
    torchrun --nproc_per_node=2 benchmarks/checkpoint.py --formats dcp         # one format per process
    torchrun --nproc_per_node=2 benchmarks/checkpoint.py --model cnn --repeats 1  # a smoke test

Each rank builds the data, model and optimizer as the script does (its build_data and build_model), trains one step
(so that the optimizer state exists: AdamW's is twice the parameters), then calls the script's save() --repeats
times per format, the formats interleaved. The sharded formats are fsdp_train.py's (--ckpt-format dcp, written by
train_extras/sharded.py); ddp_launch_train.py writes last.pt only. A thread samples each rank's resident set size
(/proc/self/statm) every
2 ms: the rise is its peak during the save (until the background write has finished, for --async-save) less its
size just before. `ru_maxrss` would not do: it is the lifetime peak. Memory that an earlier save freed is reused
by the next (the allocator keeps it), so a rise is the largest over the repeats (the first save's), and formats
are best measured one per process (--formats). The table gives the median time over the repeats of the slowest
rank, and each rank's largest rise (rank 0 is the one that gathers for last.pt).
"""
import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import common  # noqa: E402


class Resident:
    """The peak of this process's resident set size between start() and stop(), sampled in a thread."""
    PAGE = os.sysconf("SC_PAGE_SIZE")

    def now(self):
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self.PAGE

    def start(self):
        self.before, self.peak, self.running = self.now(), 0, True
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self):
        while self.running:
            self.peak = max(self.peak, self.now())
            time.sleep(0.002)

    def stop(self):
        self.running = False
        self.thread.join()
        return max(self.peak, self.now()) - self.before


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--script", default="fsdp_train.py", choices=["fsdp_train.py", "ddp_launch_train.py"],
                   help="whose build_model and save() to time")
    p.add_argument("--model", default="resnet50", help="cnn or a torchvision model")
    p.add_argument("--repeats", type=int, default=3, help="saves per format, the formats interleaved")
    p.add_argument("--formats", help="which of file, dcp, async (dcp --async-save); default: all the script has "
                   "(ddp_launch_train.py: file)")
    p.add_argument("--out-dir", help="where to write (default: a temporary folder, removed afterwards)")
    p.add_argument("--json", help="also write the results here")
    bench = p.parse_args()

    script = importlib.import_module(bench.script[:-3])
    fsdp = bench.script == "fsdp_train.py"
    formats = bench.formats or ("file,dcp,async" if fsdp else "file")
    wanted = [{"async": "dcp --async-save"}.get(f, f) for f in formats.split(",")]
    if not fsdp and wanted != ["file"]:
        p.error("--formats dcp and async are fsdp_train.py's (--ckpt-format dcp): with ddp_launch_train.py, --formats "
                "file")
    args = common.get_parser(script.__doc__).parse_args(
        ["--model", bench.model, "--optimizer", "adamw", "--train-size", "64", "--val-size", "16", "--batch-size", "2",
         "--synthetic-shape", "3x64x64", "--device", "cpu", "--workers", "0"])
    # the script's own flags, at their defaults
    args.backend, args.sync_bn, args.local_rank, args.find_unused_parameters = None, False, None, False
    if fsdp:
        args.precision, args.replicate, args.reshard_after_forward = "fp32", 1, True
        args.ckpt_format, args.async_save = "file", False
    run = script.setup_distributed(args)
    rank, world_size = run.rank, run.world_size
    run.global_batch = args.batch_size * world_size
    script.build_data(run)
    script.build_model(run)  # the model (sharded or wrapped), its optimizer and schedule
    x, y = (t[:args.batch_size].to(run.device) for t in run.train_set.tensors)
    script.train_step(run, x, y)  # the optimizer state now exists
    run.steps_per_epoch = 10
    run.position = position = common.Position(run)
    position.start_epoch(0)
    position.step_done(torch.tensor(1.0, device=run.device))
    held = sum(t.numel() * t.element_size() for t in [*run.raw_model.state_dict().values(), *[
        v for s in run.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]])  # whole model + AdamW
    scratch = tempfile.TemporaryDirectory() if bench.out_dir is None else None
    root = bench.out_dir or scratch.name
    if rank == 0:
        share = f"each rank holds about 1/{world_size}" if fsdp else "each rank holds all"
        print(f"{bench.script}, {bench.model}, AdamW, {world_size} processes: {held / 2**20:.0f} MiB of model and "
              f"optimizer state in all ({share}); writing to {root}", flush=True)
        for name in ("file", "dcp", "async"):
            os.makedirs(os.path.join(root, name), exist_ok=True)
    dist.barrier()
    # where each format goes, and its saver: None for last.pt; train_extras.sharded's Saver (what fsdp_train.py's
    # --ckpt-format dcp [--async-save] makes) for the sharded ones
    formats = {"file": (os.path.join(root, "file"), None)}
    if fsdp:
        sharded = common.optional("sharded", "--ckpt-format dcp")
        for name, folder, background in (("dcp", "dcp", False), ("dcp --async-save", "async", True)):
            run.out_dir, args.async_save = os.path.join(root, folder), background
            formats[name] = (run.out_dir, sharded.Saver(run))
        args.async_save = False
    formats = {name: f for name, f in formats.items() if name in wanted}
    results = {name: [] for name in formats}
    for repeat in range(bench.repeats):
        for name, (out_dir, saver) in formats.items():
            run.out_dir = out_dir
            if fsdp:  # (the DDP scripts' runs have no such field)
                run.sharded = saver
            position.step += 1  # a new ckpt-<step> folder each time
            memory = Resident()
            dist.barrier()
            memory.start()
            t = time.perf_counter()
            script.save(run)
            blocked = time.perf_counter() - t
            if saver is not None:
                saver.wait()  # the background write, finished (at once for a synchronous save)
            total, rise = time.perf_counter() - t, memory.stop()
            every = [None] * world_size
            dist.all_gather_object(every, (blocked, total, rise))
            results[name].append(every)
    if rank == 0:
        rows = []
        print("| format | blocked in save(), slowest rank (s) | until written (s) | rank 0's resident memory rise "
              "(MiB) | each rank's rise (MiB) |")
        print("|---|---|---|---|---|")
        for name, runs in results.items():
            row = {"format": name, "script": bench.script, "model": bench.model, "world_size": world_size,
                   "state_mib": held / 2**20,
                   "blocked_s": statistics.median(max(r[0] for r in run) for run in runs),
                   "written_s": statistics.median(max(r[1] for r in run) for run in runs),
                   "rank0_rise_mib": max(run[0][2] for run in runs) / 2**20,
                   "rise_mib_per_rank": [max(run[k][2] for run in runs) / 2**20 for k in range(world_size)],
                   "runs": runs}
            rows.append(row)
            print(f"| {name} | {row['blocked_s']:.2f} | {row['written_s']:.2f} | {row['rank0_rise_mib']:.0f} | "
                  + ", ".join(f"{r:.0f}" for r in row["rise_mib_per_rank"]) + " |")
        if bench.json:
            with open(bench.json, "w") as f:
                json.dump(rows, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    if scratch is not None and rank == 0:
        scratch.cleanup()
    sys.stdout.flush()
    # as the scripts: no interpreter teardown, where gloo's threads, kept alive by DTensor's caches and the savers,
    # now and then abort the process ("terminate called without an active exception": pytorch/pytorch#190489)
    os._exit(0)


if __name__ == "__main__":
    main()
