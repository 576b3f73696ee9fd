"""How much of the hardware's speed each training script keeps: samples/s of the four scripts against a bare
training loop, on the same model, data shape, global batch, precision and thread count, in one run.

    python benchmarks/bench.py                                  # cnn, global batch 64, on the GPU if there is one
    python benchmarks/bench.py --device cpu --json cpu.json
    python benchmarks/bench.py --device cuda --model resnet18 --batch-size 256 --precision bf16 --channels-last
    python benchmarks/bench.py --steps 3 --repeats 1 --batch-size 8   # a smoke test: checks that it runs, times nothing
    python benchmarks/bench.py --scripts ddp_launch_train.py --budget 60   # one script's row; repeats that fit 60 s

The bare loop (bare_loop below) is the reference: one process, no DDP/DataParallel wrapper, the scripts' own data
(common.load_data on the same flags, one tensor index per batch, in a random order), model, SGD and schedule, the
same autocast for bf16, zero_grad(set_to_none=True), and nothing else: no data loader, logging, NaN check or eval.
Each script runs as a subprocess on synthetic data (1x28x28, 10 classes) for --steps optimizer steps in
--epochs 1, at world size 1 (dp_train.py, plain python ddp_launch_train.py, ddp_spawn_train.py --nprocs 1,
ddp_amp_train.py); on CPU by default (or with --two-process) also ddp_spawn_train.py --nprocs 2 and
torchrun --nproc_per_node=2 ddp_launch_train.py, each process taking half the batch and half the threads.
The bare loop runs in a fresh process too, so that its start-up time and peak memory compare with the scripts'.
With --precision bf16 only ddp_amp_train.py runs (the other scripts train in fp32 only), and its torchrun row.
--shape 3x224x224 (for ImageNet models) passes --synthetic-shape to the scripts.

Columns (medians over --repeats runs, interleaved: the bare loop runs first and again after every script run, so
that each script run sits between two bare runs; each repeat starts one script later than the one before, so that
with as many repeats as scripts every script runs once in every position):
  samples/s   steady state, global batch: from the end of the first optimizer step to the end of the last
              (CUDA-synchronized); the first step (allocation, cuDNN autotuning, compilation) is not timed
  ratio       samples/s over the mean of the two bare runs around it, median over the repeats: what the script's
              wrapper, loader and bookkeeping cost. A shared machine's speed drifts from minute to minute, and
              neighbours share the drift. Range: the lowest and highest of those ratios (all of them are in the
              JSON, "ratio_runs"). At world size 1 every script should be at least 0.95; a wrapper cannot beat the
              loop it wraps, so a median above 1.05 means the reference is not doing the same work. The bare row's
              range is the reference against itself (each bare run between two others over their mean): the
              spread that comes from the machine, not from any script
  start-up s  from launching the process to the end of its first optimizer step (imports, data, model, first step;
              the last process's, of several), seen by an optimizer hook that a sitecustomize.py on PYTHONPATH
              installs in every process of the run
  eval s      the scripts' validation pass (as many samples as were trained on); the bare loop has none
  peak MB     rank 0's GPU memory allocated (CUDA), or on the CPU the largest process's peak resident set size
              (from wait4: a launcher's workers included)

Threads: every 1-process run, the bare loop included, gets this process's torch.get_num_threads() (OMP_NUM_THREADS
in its environment); each of 2 processes gets half. On a machine shared with other jobs, OMP_NUM_THREADS=1
python benchmarks/bench.py gives steadier numbers: threads that wait for a busy core slow every step.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import common  # noqa: E402

DEFAULT_SHAPE = "1x28x28"
SCRIPTS = ("dp_train.py", "ddp_launch_train.py", "ddp_spawn_train.py", "ddp_amp_train.py")
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "SLURM_STEP_NUM_TASKS")  # inherited, they would make a script wait for ranks that never come


def bare_loop(a):
    """The reference loop, run in its own process (bench.py --bare-worker); writes a metrics row as the scripts do.
    It does the scripts' work and nothing else: their flags, data (built by common.load_data, then one tensor index
    per batch in a random order), model, optimizer, schedule and threads; no wrapper, loader, logging or NaN check.

    Building the same data also gives it the scripts' memory history, which matters on CPU: glibc raises its mmap
    threshold to the largest block freed so far. A loop that never held more than a few small batches (this one did,
    until 2026-11) keeps mmapping and unmapping every step's activations, ~6,000 page faults per step for the cnn
    at batch 64, against ~50 in the scripts, and ran ~1.2x slower than the scripts it was meant to bound."""
    device = torch.device(a.device)
    common.set_threads_and_math(1, deterministic=False)  # the scripts' threads, TF32 and cuDNN autotuning settings
    args = common.get_parser("").parse_args(script_flags(a) + ["--batch-size", str(a.batch_size)])
    fmt = torch.channels_last if a.channels_last else torch.contiguous_format
    train_set, _ = common.load_data(args)
    if device.type == "cuda" and sum(t.nbytes for t in train_set.tensors) < 2**32:  # as common.make_loader does:
        train_set.tensors = tuple(t.to(device) for t in train_set.tensors)  # on the GPU if it fits, copied once
    torch.manual_seed(args.seed)
    model = common.make_model(a, train_set).to(device, memory_format=fmt)
    if a.compile:
        model.compile()
    optimizer, scheduler = common.make_optimizer(args, model, a.steps)
    order = torch.randperm(len(train_set)).view(a.steps, a.batch_size)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.precision == "bf16")
    model.train()
    for step in range(a.steps):
        x, y = (t.to(device, non_blocking=True) for t in train_set[order[step].to(train_set.tensors[0].device)])
        x = x.contiguous(memory_format=fmt)
        with autocast:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step == 0:  # not timed: the first step, as in the scripts
            sync(device)
            t0 = time.perf_counter()
    sync(device)
    row = {"samples_per_s": (a.steps - 1) * a.batch_size / (time.perf_counter() - t0), "eval_time_s": None,
           "world_size": 1,
           "peak_mem_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None}
    os.makedirs(a.out_dir, exist_ok=True)
    with open(os.path.join(a.out_dir, "metrics.jsonl"), "w") as f:  # the scripts' format, one row
        f.write(json.dumps(row) + "\n")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def script_flags(a):
    """The flags every row's script gets, but --batch-size (per process) and --out-dir; the bare loop parses them
    too."""
    return (["--device", a.device, "--model", a.model] + ["--channels-last"] * a.channels_last
            + ["--compile"] * a.compile + ["--dataset", "synthetic", "--epochs", "1", "--max-steps", str(a.steps),
                                           "--train-size", str(a.steps * a.batch_size),
                                           "--val-size", str(a.val_size or a.steps * a.batch_size)]
            + (["--synthetic-shape", a.shape] if a.shape != DEFAULT_SHAPE else []))


def configs(a, threads):
    """(name, world_size, command, OMP_NUM_THREADS) of every row, the bare loop first."""
    py, B, cuda = sys.executable, a.batch_size, a.device == "cuda"
    script = lambda name: os.path.join(ROOT, name)  # noqa: E731
    one = script_flags(a) + ["--batch-size", str(B)]
    bare = [py, os.path.abspath(__file__), "--bare-worker", "--batch-size", str(B), "--steps", str(a.steps),
            "--precision", a.precision, "--shape", a.shape, "--device", a.device, "--model", a.model]
    bare += ["--channels-last"] * a.channels_last + ["--compile"] * a.compile
    bare += ["--val-size", str(a.val_size)] if a.val_size else []
    rows = [("bare", 1, bare, threads)]
    if a.precision == "fp32":  # these three have no --precision: they train in fp32 only
        rows += [("dp_train.py", 1, [py, script("dp_train.py")] + one + ["--gpus", "0"] * cuda, threads),
                 ("ddp_launch_train.py", 1, [py, script("ddp_launch_train.py")] + one, threads),
                 ("ddp_spawn_train.py", 1, [py, script("ddp_spawn_train.py"), "--nprocs", "1"] + one, threads)]
    rows.append(("ddp_amp_train.py", 1, [py, script("ddp_amp_train.py"), "--precision", a.precision] + one, threads))
    if a.two_process:  # the same global batch over two processes
        two, half = script_flags(a) + ["--batch-size", str(B // 2)], max(1, threads // 2)
        torchrun = [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        if a.precision == "fp32":
            rows.append(("ddp_spawn_train.py", 2, [py, script("ddp_spawn_train.py"), "--nprocs", "2"] + two, half))
            rows.append(("torchrun ddp_launch_train.py", 2, torchrun + [script("ddp_launch_train.py")] + two, half))
        else:
            amp = [script("ddp_amp_train.py"), "--precision", a.precision]
            rows.append(("torchrun ddp_amp_train.py", 2, torchrun + amp + two, half))
    if a.scripts:  # only these scripts' rows, and the bare loop
        rows = rows[:1] + [r for r in rows[1:] if r[0].split()[-1] in a.scripts]
    return rows


# Imported first by every Python process of a run (sitecustomize.py on PYTHONPATH, where BENCH_FIRST_STEP names a
# folder; not by mp.spawn's resource tracker, which trains nothing): the time at the end of the process's first
# optimizer step (CUDA-synchronized), written to BENCH_FIRST_STEP/<pid>. The scripts' metrics do not keep it; it is
# the end of start-up, for the bare loop and every script alike, measured by torch's own optimizer hook.
FIRST_STEP = """
import os, sys
if os.environ.get("BENCH_FIRST_STEP") and "multiprocessing.resource_tracker" not in " ".join(sys.orig_argv):
    import time
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def _first_step(optimizer, args, kwargs, _done=[]):
        if not _done:
            _done.append(True)
            if torch.cuda.is_initialized():
                torch.cuda.synchronize()
            path = os.path.join(os.environ["BENCH_FIRST_STEP"], str(os.getpid()))
            with open(path + ".tmp", "w") as f:
                f.write(repr(time.time()))
            os.replace(path + ".tmp", path)
    register_optimizer_step_post_hook(_first_step)
"""


def run(cmd, threads, timeout):
    """Run one command in a fresh process group; its metrics row, with its start-up time (from the launch to the end
    of the first optimizer step, the last process's to get there) and, on the CPU, the peak resident memory of its
    largest process (the scripts log GPU memory only)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory() as out:
        hook, first = os.path.join(out, "hook"), os.path.join(out, "first_step")
        os.makedirs(hook)
        os.makedirs(first)
        with open(os.path.join(hook, "sitecustomize.py"), "w") as f:
            f.write(FIRST_STEP)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [hook, env.get("PYTHONPATH")]))
        env["BENCH_FIRST_STEP"] = first
        with open(os.path.join(out, "stderr"), "w+") as err:
            launched = time.time()
            p = subprocess.Popen(cmd + ["--out-dir", os.path.join(out, "run")], env=env, cwd=ROOT,
                                 stdout=subprocess.DEVNULL, stderr=err,
                                 start_new_session=True)  # its own group: a timeout ends its children too
            # wait4, not wait: the resources it used, its children's (reaped by it: torchrun's and mp.spawn's
            # workers) included; ru_maxrss is then the largest one process's peak resident set size, in KiB
            while True:
                pid, status, usage = os.wait4(p.pid, os.WNOHANG)
                if pid:
                    p.returncode = os.waitstatus_to_exitcode(status)
                    break
                if time.time() - launched > timeout:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                    sys.exit(f"timed out after {timeout}s: {' '.join(cmd)}")
                time.sleep(0.02)
            if p.returncode != 0:
                err.seek(0)
                sys.exit(f"exit status {p.returncode}: {' '.join(cmd)}\n{err.read()[-3000:]}")
        with open(os.path.join(out, "run", "metrics.jsonl")) as f:
            row = json.loads(f.readlines()[-1])
        ends = [float(open(os.path.join(first, name)).read()) for name in os.listdir(first) if name.isdigit()]
    if not ends:
        sys.exit(f"no optimizer step was seen (sitecustomize.py not imported?): {' '.join(cmd)}")
    mem = row["peak_mem_mb"]
    mem = usage.ru_maxrss / 1024 if mem is None else max(mem) if isinstance(mem, list) else mem
    return {"samples_per_s": row["samples_per_s"], "startup_s": max(ends) - launched, "eval_s": row["eval_time_s"],
            "peak_mem_mb": mem}


def verdict(table):
    """The line that judges the table: every script at world size 1 at least 0.95 of the bare loop (median), none
    above 1.05. When one bare run against its neighbours is off by more than 0.05, single ratios spread as far, and a
    median of a few repeats cannot tell 0.94 from 0.96: the line says so."""
    ones = [t for t in table if t["world_size"] == 1 and t["name"] != "bare"]
    low = [t["name"] for t in ones if t["ratio_to_bare"] < 0.95]
    high = [t["name"] for t in ones if t["ratio_to_bare"] > 1.05]
    line = "world size 1, median ratio at least 0.95: " + ("met" if not low else "NOT met: " + ", ".join(low))
    if high:
        line += "; above 1.05 (faster than the loop they wrap: look for the reason): " + ", ".join(high)
    itself = next(t["ratio_runs"] for t in table if t["name"] == "bare")
    if itself and (min(itself) < 0.95 or max(itself) > 1.05):
        line += (f"\nbut the bare loop against itself spread {min(itself):.2f}-{max(itself):.2f}: the machine was too "
                 "busy to decide; run again when it is quiet, or with more --repeats")
    return line


def main(a):
    threads = torch.get_num_threads()
    a.two_process = a.device == "cpu" if a.two_process is None else a.two_process
    if a.two_process and (a.batch_size % 2 or (a.device == "cuda" and torch.cuda.device_count() < 2)):
        sys.exit("--two-process needs an even --batch-size" + (", and 2 GPUs on CUDA" if a.device == "cuda" else ""))
    rows = configs(a, threads)
    bare, scripts = rows[0], rows[1:]
    runs, threads_of = {(name, ws): [] for name, ws, _, _ in rows}, {(name, ws): t for name, ws, _, t in rows}
    ratios = {(name, ws): [] for name, ws, _, _ in rows}

    def timed(row, r):  # one run of a row; its samples/s
        name, ws, cmd, t = row
        runs[name, ws].append(run(cmd, t, a.timeout))
        print(f"repeat {r + 1}/{a.repeats}  {name} x{ws}: {runs[name, ws][-1]['samples_per_s']:.1f} samples/s",
              file=sys.stderr, flush=True)
        return runs[name, ws][-1]["samples_per_s"]

    # every script run sits between two bare runs and is divided by their mean: the machine's speed drifts from
    # minute to minute, and the neighbours share the drift. Each bare run in between is also divided by the mean of
    # its neighbours: the spread of the reference against itself, what any ratio's spread should be read against
    # --budget: no repeat is started that would end past it, going by the last repeat's time (one always runs)
    start, last = time.time(), 0.0
    before = timed(bare, 0)
    bare_speeds = [before]
    for r in range(a.repeats):
        t = time.time()
        if r and a.budget and t - start + last > a.budget:
            print(f"--budget {a.budget:.0f} s: {r} of {a.repeats} repeats fit", file=sys.stderr, flush=True)
            a.repeats = r
            break
        for row in scripts[r % len(scripts):] + scripts[:r % len(scripts)]:  # rotated: every script in every position
            speed = timed(row, r)
            after = timed(bare, r)
            ratios[row[:2]].append(speed / ((before + after) / 2))
            bare_speeds.append(after)
            before = after
        last = time.time() - t
    ratios["bare", 1] = [b / ((x + y) / 2) for x, b, y in zip(bare_speeds, bare_speeds[1:], bare_speeds[2:])]
    median = lambda rs, k: None if rs[0][k] is None else statistics.median(x[k] for x in rs)  # noqa: E731
    table = [{"name": name, "device": a.device, "world_size": ws, "precision": a.precision, "model": a.model,
              "shape": a.shape, "global_batch": a.batch_size, "steps": a.steps, "repeats": a.repeats,
              "threads": threads_of[name, ws], **{k: median(rs, k) for k in rs[0]},
              "ratio_to_bare": 1.0 if name == "bare" else statistics.median(ratios[name, ws]),
              "ratio_runs": ratios[name, ws],
              "samples_per_s_runs": [x["samples_per_s"] for x in rs]} for (name, ws), rs in runs.items()]
    print(f"\n{a.model} {a.shape} {a.precision}, global batch {a.batch_size}, {a.steps} steps, "
          f"median of {a.repeats}, {threads} CPU threads per 1-process run")
    print(f"{'name':30} {'device':6} {'world':>5} {'samples/s':>10} {'ratio':>6} {'range':>11} {'start-up s':>10} "
          f"{'eval s':>7} {'peak MB':>8}")
    for t in table:
        ev = "-" if t["eval_s"] is None else f"{t['eval_s']:.2f}"
        spread = f"{min(t['ratio_runs']):.2f}-{max(t['ratio_runs']):.2f}" if t["ratio_runs"] else "-"
        print(f"{t['name']:30} {t['device']:6} {t['world_size']:5d} {t['samples_per_s']:10.1f} "
              f"{t['ratio_to_bare']:6.2f} {spread:>11} {t['startup_s']:10.2f} {ev:>7} {t['peak_mem_mb']:8.0f}")
    print(verdict(table))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(table, f, indent=1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="cnn", help="cnn or a torchvision model name, as in the scripts")
    p.add_argument("--batch-size", type=int, default=64, help="global batch (per process: this over the world size)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per run, the first one untimed (at least 2)")
    p.add_argument("--repeats", type=int, default=5,
                   help="runs of every row, interleaved; the table shows medians and the range of the ratios")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: autocast; only ddp_amp_train.py has it, so the fp32-only scripts are left out")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (the first step compiles: untimed)")
    p.add_argument("--two-process", action=argparse.BooleanOptionalAction,
                   help="also the 2-process rows (default: on CPU only; on CUDA they need 2 GPUs)")
    p.add_argument("--shape", default=DEFAULT_SHAPE, help="synthetic image shape CxHxW, e.g. 3x224x224")
    p.add_argument("--val-size", type=int, help="validation samples of each script run (default: as many as trained "
                   "on; fewer makes large images start faster, and eval s then times fewer)")
    p.add_argument("--scripts", nargs="+", metavar="SCRIPT", help="only these scripts' rows (and the bare loop), "
                   "e.g. ddp_launch_train.py; default: all")
    p.add_argument("--budget", type=float, help="seconds for the whole benchmark: no repeat is started that would end "
                   "past it, going by the previous repeat's time (at least one runs); the JSON says how many did")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed for each run")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--bare-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.steps < 2 or args.repeats < 1 or args.batch_size < 1:
        p.error("--steps must be at least 2, --repeats and --batch-size at least 1")
    if args.scripts and not set(args.scripts) <= set(SCRIPTS):
        p.error(f"--scripts: choose among {', '.join(SCRIPTS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but this machine has no CUDA GPU")
    bare_loop(args) if args.bare_worker else main(args)
