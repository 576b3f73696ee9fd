"""Parity of every training script with the loop a user would write by hand, started the same way, at world sizes 1
and 2: steady-state speed, peak memory, start-up, and the trained weights, checked equal.

    python benchmarks/bench.py --device cpu --json cpu.json      # every row, 5 repeats: ~25 minutes on 2 cores
    python benchmarks/bench.py --scripts fsdp_train.py --world-sizes 2 --budget 300
    python benchmarks/bench.py --device cuda --model resnet18 --shape 3x32x32 --batch-size 256
    python benchmarks/bench.py --steps 3 --repeats 1 --batch-size 8   # a smoke test: checks that it runs, times nothing

The references (reference() below), each started as its script is, each a loop with nothing but the training:
  bare loop                 python bench.py, one process, no wrapper        for dp_train.py
  DDP under torchrun        torchrun --nproc_per_node=N, DDP                for ddp_launch_train.py, ddp_amp_train.py
  DDP under mp.spawn        python bench.py, mp.spawn of N processes, DDP   for ddp_spawn_train.py --nprocs N
  fully_shard under torchrun  torchrun --nproc_per_node=N, FSDP2            for fsdp_train.py
Each does the scripts' work and no more: their data (common.load_data on the same flags), sharded and ordered as
the scripts do it (DistributedSampler(seed, drop_last=True), set_epoch), one tensor index per batch, the same init
seed, model, wrapper options (DDP's gradient_as_bucket_view; fully_shard per child, then the root), SGD, schedule,
autocast (bf16) and threads; no checks, logging, loader or evaluation. Scripts and references train on synthetic data
(1x28x28, 10 classes; --shape) for --steps optimizer steps in one epoch, and train the same global batch: each of
N processes takes 1/N of it, and 1/N of this process's threads (world size 1: all of them). On a CUDA machine with
fewer GPUs than processes, they share GPU 0 over gloo (NCCL refuses two ranks on one GPU).

A group is a reference and the rows it judges, at one world size. In each repeat every group runs as a block: its
reference, then each script followed by the reference again, so that every script run sits between two reference
runs started the same way. The groups, and the scripts in a group, start one later in each repeat.

Columns (medians over the repeats):
  samples/s   steady state, global batch, from the end of the first optimizer step to the end of the last
              (CUDA-synchronized): the scripts' metrics.jsonl, the reference's own clock
  ratio       samples/s over the mean of the two reference runs around it; range: the lowest and highest
  ref spread  the reference's own runs of the group: each over their median, lowest and highest. A ratio is
              decided only where these stay within 0.95-1.05: a busier machine is not measuring the scripts
  start-up s  from launching the command to the end of the first optimizer step (the last process's), seen by an
              optimizer hook that a sitecustomize.py on PYTHONPATH installs in every process
  peak MB     up to the end of the last optimizer step, the largest process's: its peak resident set size on a
              CPU, torch.cuda.max_memory_allocated on a GPU (the same hook)
  weights     the script's last.pt against the weights of the reference run before it: torch.equal, every tensor
Parity (the verdict under the table): speed ratio at least 0.95 (median); peak memory at most the reference's
+5%; start-up at most the reference's + 1.5 s; weights equal. Unequal weights exit 1: a script that does not
train what its reference trains is not being timed on the same work.
"""
import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import common  # noqa: E402

DEFAULT_SHAPE = "1x28x28"
SCRIPTS = ("dp_train.py", "ddp_launch_train.py", "ddp_amp_train.py", "ddp_spawn_train.py", "fsdp_train.py")
REFERENCES = {"bare": "bare loop", "ddp-torchrun": "DDP under torchrun", "ddp-spawn": "DDP under mp.spawn",
              "fsdp-torchrun": "fully_shard under torchrun"}
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "SLURM_STEP_NUM_TASKS")  # inherited, they would make a script wait for ranks that never come
SPEED, MEMORY, STARTUP_S, SPREAD = 0.95, 1.05, 1.5, 0.05  # the parity criteria


def reference(a):
    """One process of a reference (bench.py --reference KIND): the scripts' training and nothing else. It writes the
    scripts' metrics row and, on rank 0, its weights.

    It builds the scripts' data, which also gives it their memory history. That matters on a CPU: glibc raises its
    mmap threshold to the largest block freed so far. A loop that never held more than a few small batches (this one
    did, until 2026-11) keeps mapping and unmapping every step's activations, ~6,000 page faults per step for the
    cnn at batch 64 against ~50 in the scripts, and ran ~1.2x slower than the scripts it was meant to bound."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data.distributed import DistributedSampler
    kind, rank, world = a.reference.split("-")[0], int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(a.device)
    if device.type == "cuda":  # as common.local_device: processes beyond the GPUs share them
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    common.set_threads_and_math(1, a.deterministic)  # the scripts' TF32 and cuDNN settings (threads: given)
    if kind != "bare":
        dist.init_process_group(a.backend or dist.get_default_backend_for_device(device))
    args = common.get_parser("").parse_args(script_flags(a) + ["--batch-size", str(a.batch_size // world)])
    fmt = torch.channels_last if a.channels_last else torch.contiguous_format
    train_set, _ = common.load_data(args)
    if device.type == "cuda" and sum(t.nbytes for t in train_set.tensors) < 2**32:  # as InMemory.batch_loader does:
        train_set.tensors = tuple(t.to(device) for t in train_set.tensors)  # on the GPU if it fits, copied once
    sampler = DistributedSampler(train_set, world, rank, shuffle=True, seed=args.seed, drop_last=True)
    sampler.set_epoch(0)
    order = torch.tensor(list(sampler)).view(-1, args.batch_size)[:a.steps].to(train_set.tensors[0].device)
    torch.manual_seed(args.seed)
    model = common.make_model(args, train_set).to(device, memory_format=fmt)
    if kind == "ddp":
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    elif kind == "fsdp":
        mesh = init_device_mesh(device.type, (world,))
        for child in model.children():
            if next(child.parameters(), None) is not None:
                fully_shard(child, mesh=mesh, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, reshard_after_forward=True)
    if a.compile:
        model.compile()
    optimizer, scheduler = common.make_optimizer(args, model, a.steps)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.precision == "bf16")
    model.train()
    for step in range(a.steps):
        x, y = (t.to(device, non_blocking=True) for t in train_set[order[step]])
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
    speed = (a.steps - 1) * a.batch_size / (time.perf_counter() - t0)
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) \
        if kind == "fsdp" else (model.module if kind == "ddp" else model).state_dict()
    if rank == 0:
        os.makedirs(a.out_dir, exist_ok=True)
        torch.save(weights, os.path.join(a.out_dir, "weights.pt"))
        with open(os.path.join(a.out_dir, "metrics.jsonl"), "w") as f:  # the scripts' format, one row
            f.write(json.dumps({"samples_per_s": speed, "eval_time_s": None, "world_size": world}) + "\n")
    if kind != "bare":
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # as the scripts: no interpreter teardown, where gloo's threads may hang (pytorch/pytorch#190489)


def spawn_reference(a):
    """DDP under mp.spawn: the parent picks a free port and starts --nprocs processes, each a reference()."""
    import torch.multiprocessing as mp
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    with socket.socket() as s:
        s.bind(("", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    mp.spawn(spawned, args=(a,), nprocs=a.nprocs)


def spawned(rank, a):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(a.nprocs))
    reference(a)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def script_flags(a):
    """The flags every script gets, but --batch-size (per process), --backend and --out-dir; the references parse
    them too."""
    return (["--device", a.device, "--model", a.model] + ["--channels-last"] * a.channels_last
            + ["--compile"] * a.compile + ["--deterministic"] * a.deterministic
            + ["--dataset", "synthetic", "--epochs", "1", "--max-steps", str(a.steps),
               "--train-size", str(a.steps * a.batch_size), "--val-size", str(a.val_size or a.batch_size)]
            + (["--synthetic-shape", a.shape] if a.shape != DEFAULT_SHAPE else []))


def groups(a, threads):
    """[(reference row, [script rows])], a row being (name, world size, command, OMP_NUM_THREADS, how it starts)."""
    py, cuda = sys.executable, a.device == "cuda"
    found = []
    for ws in a.world_sizes:
        flags = script_flags(a) + ["--batch-size", str(a.batch_size // ws)]
        gloo = ["--backend", "gloo"] if cuda and torch.cuda.device_count() < ws else []  # 2 ranks on 1 GPU
        torchrun = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ws}"]
        bench = [os.path.abspath(__file__), "--steps", str(a.steps), "--batch-size", str(a.batch_size),
                 "--precision", a.precision, "--shape", a.shape, "--device", a.device, "--model", a.model]
        bench += ["--channels-last"] * a.channels_last + ["--compile"] * a.compile
        bench += ["--deterministic"] * a.deterministic + gloo + (["--val-size", str(a.val_size)] if a.val_size else [])
        t, fp32 = threads if ws == 1 else max(1, threads // ws), a.precision == "fp32"  # the others: fp32 only

        def torchrun_row(name, *more):
            return name, ws, torchrun + [os.path.join(ROOT, name), *more] + flags + gloo, t, \
                " ".join([f"torchrun --nproc_per_node={ws} {name}", *more])

        def reference_row(kind, launch, *more):
            return kind, ws, launch + bench + ["--reference", kind, *more], t, f"{REFERENCES[kind]} (reference)"
        found += [
            (reference_row("bare", [py]),
             [("dp_train.py", ws, [py, os.path.join(ROOT, "dp_train.py")] + flags + ["--gpus", "0"] * cuda, t,
               "python dp_train.py")] if ws == 1 and fp32 else []),
            (reference_row("ddp-torchrun", torchrun),
             [torchrun_row("ddp_launch_train.py")] * fp32 + [torchrun_row("ddp_amp_train.py", "--precision",
                                                                             a.precision)]),
            (reference_row("ddp-spawn", [py], "--nprocs", str(ws)),
             [("ddp_spawn_train.py", ws, [py, os.path.join(ROOT, "ddp_spawn_train.py"), "--nprocs", str(ws)]
               + flags + gloo, t, f"python ddp_spawn_train.py --nprocs {ws}")] * fp32),
            (reference_row("fsdp-torchrun", torchrun), [torchrun_row("fsdp_train.py")] * fp32)]
    found = [(ref, [s for s in rows if not a.scripts or s[0] in a.scripts]) for ref, rows in found]
    return [(ref, rows) for ref, rows in found if rows]


# Imported first by every Python process of a run (sitecustomize.py on PYTHONPATH, where BENCH_STEPS is set; not by
# mp.spawn's resource tracker, which trains nothing): at the end of the first optimizer step (CUDA-synchronized) and
# of the last, --steps, what the process holds: the time (first step), its peak resident set size, and on a GPU
# torch.cuda.max_memory_allocated. Written to BENCH_RECORDS/<pid>-<step>; the same hook in scripts and references.
HOOK = """
import os, sys
if os.environ.get("BENCH_STEPS") and "multiprocessing.resource_tracker" not in " ".join(sys.orig_argv):
    import json, resource, time
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def _record(optimizer, args, kwargs, _steps=[0]):
        _steps[0] += 1
        if _steps[0] in (1, int(os.environ["BENCH_STEPS"])):
            cuda = torch.cuda.is_initialized()
            if cuda and _steps[0] == 1:
                torch.cuda.synchronize()
            record = {"step": _steps[0], "time": time.time(),
                      "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "cuda_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None}
            path = os.path.join(os.environ["BENCH_RECORDS"], f"{os.getpid()}-{_steps[0]}")
            with open(path + ".tmp", "w") as f:
                json.dump(record, f)
            os.replace(path + ".tmp", path)
    register_optimizer_step_post_hook(_record)
"""


def run(cmd, threads, a):
    """Run one command in a fresh process group: its samples/s (its metrics row), start-up (from the launch to the end
    of the first optimizer step, the last process's), peak memory up to the last step (the largest process's), and
    the weights it trained (a script's last.pt, a reference's weights.pt)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory() as out:
        hook, records = os.path.join(out, "hook"), os.path.join(out, "records")
        os.makedirs(hook)
        os.makedirs(records)
        with open(os.path.join(hook, "sitecustomize.py"), "w") as f:
            f.write(HOOK)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [hook, env.get("PYTHONPATH")]))
        env["BENCH_STEPS"], env["BENCH_RECORDS"] = str(a.steps), records
        with open(os.path.join(out, "stderr"), "w+") as err:
            launched = time.time()
            p = subprocess.Popen(cmd + ["--out-dir", os.path.join(out, "run")], env=env, cwd=ROOT,
                                 stdout=subprocess.DEVNULL, stderr=err,
                                 start_new_session=True)  # its own group: a timeout ends its children too
            try:
                p.wait(timeout=a.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                sys.exit(f"timed out after {a.timeout}s: {' '.join(cmd)}")
            if p.returncode != 0:
                err.seek(0)
                sys.exit(f"exit status {p.returncode}: {' '.join(cmd)}\n{err.read()[-3000:]}")
        with open(os.path.join(out, "run", "metrics.jsonl")) as f:
            row = json.loads(f.readlines()[-1])
        found = {}  # each process's records, by step
        for name in (n for n in os.listdir(records) if not n.endswith(".tmp")):
            pid, step = name.split("-")
            with open(os.path.join(records, name)) as f:
                found.setdefault(pid, {})[int(step)] = json.load(f)
        path = os.path.join(out, "run", "last.pt")
        weights = torch.load(path, map_location="cpu", weights_only=True)["model"] if os.path.exists(path) else \
            torch.load(os.path.join(out, "run", "weights.pt"), map_location="cpu", weights_only=True)
    firsts = [r[1]["time"] for r in found.values() if 1 in r]
    if not firsts:
        sys.exit(f"no optimizer step was seen (sitecustomize.py not imported?): {' '.join(cmd)}")
    key = "cuda_mb" if a.device == "cuda" else "rss_mb"
    return {"samples_per_s": row["samples_per_s"], "startup_s": max(firsts) - launched,
            "eval_s": row["eval_time_s"], "peak_mem_mb": max(r[max(r)][key] for r in found.values()),
            "weights": weights}


def same_weights(mine, theirs):
    """None if every tensor is equal (torch.equal), else the first name that differs."""
    if mine.keys() != theirs.keys():
        return f"names: {sorted(mine.keys() ^ theirs.keys())[:3]}"
    return next((k for k in mine if not torch.equal(mine[k], theirs[k])), None)


def rotated(items, r):
    return items[r % len(items):] + items[:r % len(items)]


def judge(row, ref):
    """A script row's four parity verdicts against its reference's row: met, NOT met, or undecided."""
    busy = any(abs(x - 1) > SPREAD for x in ref["ratio_runs"])  # the reference against itself
    weights = "undecided: the reference differs from itself" if any(ref["weights_differ"]) else \
        "NOT met: " + next(d for d in row["weights_differ"] if d) if any(row["weights_differ"]) else "met"
    return {"speed": "undecided: the reference spread" if busy else "met" if row["ratio"] >= SPEED else "NOT met",
            "memory": "met" if row["peak_mem_mb"] <= MEMORY * ref["peak_mem_mb"] else "NOT met",
            "startup": "met" if row["startup_s"] <= ref["startup_s"] + STARTUP_S else "NOT met",
            "weights": weights}


def tabulate(plan, runs, ratios, differ, a):
    """The rows, each group's reference first: medians, ratios, spreads and, for the scripts, the verdicts."""
    table = []
    for ref, rows in plan:
        for name, ws, _, threads, label in [ref] + rows:
            rs = runs[name, ws]
            row = {"name": name, "reference": ref[0], "world_size": ws, "launch": label,
                   "device": a.device, "precision": a.precision, "model": a.model, "shape": a.shape,
                   "global_batch": a.batch_size, "steps": a.steps, "repeats": a.repeats, "threads": threads,
                   **{k: None if rs[0][k] is None else statistics.median(x[k] for x in rs) for k in rs[0]},
                   "samples_per_s_runs": [x["samples_per_s"] for x in rs], "weights_differ": differ[name, ws]}
            if name == ref[0]:  # the reference against itself: each run over the median of its runs
                row |= {"ratio": 1.0, "ratio_runs": [x / row["samples_per_s"] for x in row["samples_per_s_runs"]]}
                ref_row = row
            else:
                row |= {"ratio": statistics.median(ratios[name, ws]), "ratio_runs": ratios[name, ws],
                        "reference_samples_per_s": ref_row["samples_per_s"],
                        "reference_startup_s": ref_row["startup_s"],
                        "reference_peak_mem_mb": ref_row["peak_mem_mb"]}
                row["verdict"] = judge(row, ref_row)
            table.append(row)
    return table


def show(table, a, threads):
    print(f"\n{a.model} {a.shape} {a.precision}, global batch {a.batch_size}, {a.steps} steps, median of the "
          f"repeats, {threads} CPU threads per 1-process run (each of 2 processes: half)")
    print(f"{'run':44} {'world':>5} {'samples/s':>10} {'ratio':>6} {'range':>11} {'start-up s':>10} {'peak MB':>8}  "
          "weights")
    for t in table:
        ref = t["name"] == t["reference"]
        spread = f"{min(t['ratio_runs']):.2f}-{max(t['ratio_runs']):.2f}" if t["ratio_runs"] else "-"
        weights = "-" if ref else "equal" if not any(t["weights_differ"]) else "DIFFER"
        print(f"{t['launch'][:44]:44} {t['world_size']:5d} {t['samples_per_s']:10.1f} {t['ratio']:6.2f} {spread:>11} "
              f"{t['startup_s']:10.2f} {t['peak_mem_mb']:8.0f}  {weights}")
    print("\nparity (speed ratio >= 0.95, the reference within +-5%; memory <= reference +5%; start-up <= reference "
          "+ 1.5 s; weights torch.equal):")
    for t in table:
        if t["name"] != t["reference"]:
            v = t["verdict"]
            print(f"  {t['name']} x{t['world_size']}: " + "; ".join(f"{k} {v[k]}" for k in v))
    missed = [f"{t['name']} x{t['world_size']}" for t in table if "verdict" in t
              and any(not x.startswith(("met", "undecided")) for x in t["verdict"].values())]
    undecided = [f"{t['name']} x{t['world_size']}" for t in table if "verdict" in t
                 and any(x.startswith("undecided") for x in t["verdict"].values())]
    print("parity: " + ("met in every row" if not missed and not undecided else
                        "; ".join(filter(None, ["NOT met: " + ", ".join(missed) if missed else "",
                                                "undecided (run again when the machine is quiet): "
                                                + ", ".join(undecided) if undecided else ""]))))


def main(a):
    threads = torch.get_num_threads()
    plan = groups(a, threads)
    if not plan:
        sys.exit("no row: --scripts and --world-sizes leave none (dp_train.py has world size 1 only)")
    runs = {row[:2]: [] for ref, rows in plan for row in [ref] + rows}
    ratios, differ = {k: [] for k in runs}, {k: [] for k in runs}

    def timed(row, r):  # one run of a row
        name, ws, cmd, t, _ = row
        began = time.time()
        result = run(cmd, t, a)
        runs[name, ws].append({k: v for k, v in result.items() if k != "weights"})
        print(f"repeat {r + 1}/{a.repeats}  {name} x{ws}: {result['samples_per_s']:.1f} samples/s "
              f"(start-up {result['startup_s']:.1f} s, the whole run {time.time() - began:.1f} s)",
              file=sys.stderr, flush=True)
        return result

    # --budget: no repeat is started that would end past it, going by the last repeat's time (one always runs)
    start, last = time.time(), 0.0
    for r in range(a.repeats):
        t = time.time()
        if r and a.budget and t - start + last > a.budget:
            print(f"--budget {a.budget:.0f} s: {r} of {a.repeats} repeats fit", file=sys.stderr, flush=True)
            a.repeats = r
            break
        for ref, rows in rotated(plan, r):  # a block: the reference, then each script and the reference again
            before = timed(ref, r)
            for row in rotated(rows, r):
                mine, after = timed(row, r), timed(ref, r)
                ratios[row[:2]].append(mine["samples_per_s"] / ((before["samples_per_s"] + after["samples_per_s"]) / 2))
                differ[row[:2]].append(same_weights(mine["weights"], before["weights"]))
                differ[ref[:2]].append(same_weights(after["weights"], before["weights"]))
                before = after
        last = time.time() - t
        if a.json:  # after every repeat: a command stopped at its time limit keeps what it measured
            so_far = argparse.Namespace(**{**vars(a), "repeats": r + 1})
            with open(a.json, "w") as f:
                json.dump(tabulate(plan, runs, ratios, differ, so_far), f, indent=1)
    table = tabulate(plan, runs, ratios, differ, a)
    show(table, a, threads)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(table, f, indent=1)
    unequal = [t for t in table if "verdict" in t and t["verdict"]["weights"].startswith("NOT")]
    if unequal:
        sys.exit(f"weights differ from the reference's: {', '.join(t['name'] for t in unequal)} did not train "
                 "what its reference trained")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="cnn", help="cnn or a torchvision model name, as in the scripts")
    p.add_argument("--batch-size", type=int, default=64, help="global batch (per process: this over the world size)")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps per run, the first one untimed (at least 2)")
    p.add_argument("--repeats", type=int, default=5, help="blocks of every group; the table shows medians and ranges")
    p.add_argument("--world-sizes", type=int, nargs="+", choices=[1, 2], default=[1, 2],
                   help="processes per run (2 on one GPU: gloo)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                   help="bf16: autocast; only ddp_amp_train.py has it, so the fp32-only scripts are left out")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (the first step compiles: untimed)")
    p.add_argument("--deterministic", action="store_true", help="the scripts' --deterministic (no TF32, cuDNN "
                   "deterministic): on a GPU, what makes two runs' weights equal")
    p.add_argument("--shape", default=DEFAULT_SHAPE, help="synthetic image shape CxHxW, e.g. 3x224x224")
    p.add_argument("--val-size", type=int, help="validation samples of each script run (default: one global batch; "
                   "the scripts' evaluation is not timed here)")
    p.add_argument("--scripts", nargs="+", metavar="SCRIPT", help="only these scripts' rows (and their references), "
                   "e.g. ddp_launch_train.py; default: all")
    p.add_argument("--budget", type=float, help="seconds for the whole benchmark: no repeat is started that would end "
                   "past it, going by the previous repeat's time (at least one runs); the JSON says how many did")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed for each run")
    p.add_argument("--json", help="also write the rows to this JSON file")
    p.add_argument("--reference", choices=list(REFERENCES), help=argparse.SUPPRESS)  # a reference's own processes
    p.add_argument("--nprocs", type=int, help=argparse.SUPPRESS)
    p.add_argument("--backend", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 2 or args.repeats < 1 or args.batch_size < 1:
        p.error("--steps must be at least 2, --repeats and --batch-size at least 1")
    if args.batch_size % max(args.world_sizes):
        p.error(f"--batch-size {args.batch_size}: the global batch must divide over {max(args.world_sizes)} processes")
    if args.scripts and not set(args.scripts) <= set(SCRIPTS):
        p.error(f"--scripts: choose among {', '.join(SCRIPTS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but this machine has no CUDA GPU")
    return args


if __name__ == "__main__":
    args = parse_args()
    if args.reference == "ddp-spawn" and "RANK" not in os.environ:
        spawn_reference(args)
    elif args.reference:
        reference(args)
    else:
        main(args)
