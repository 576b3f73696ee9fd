"""The GPU report: every script proven and timed on one CUDA GPU, in two commands that each fit a 10-minute slot,
with nothing to install (torch, torchvision, tqdm and pytest only).

    python3 benchmarks/gpu_report.py --part tests      # tests/test_gpu.py: under 6 minutes
    python3 benchmarks/gpu_report.py --part bench      # the GPU rows of docs/performance.md: under 8 minutes
    python3 benchmarks/gpu_report.py --dry-run         # both parts on the CPU, small: checks this script and the tests

Each part writes into --out (default runs/gpu_report) a JSON and a Markdown table, headed by the GPU's name, the
torch version and the date: tests.json/tests.md (every test's outcome, time and the numbers it recorded) and
bench.json/bench.md (every row of every configuration, its ratio to its reference in benchmarks/bench.py, and the
targets). The GPU table in docs/performance.md is copied from bench.md. Both print where each minute went.

The bench part runs benchmarks/bench.py once per configuration, each with a time budget (--budget: it starts no
repeat that would end past it); every script row against its own reference, started the same way (bench.py):
  resnet50 3x224x224, batch 128, fp32 with TF32, world size 1: the five scripts
  the same in bf16 with --channels-last: ddp_amp_train.py
  resnet18 3x32x32, batch 256, eager and --compile, world size 1: ddp_launch_train.py
  resnet18 3x32x32, batch 256, --deterministic, world size 2: the four DDP and FSDP scripts, both processes on the
    one GPU over gloo (NCCL refuses two ranks on one GPU)
Targets: every script at least 0.95 of its reference on resnet50 at 224x224; bf16 + channels-last at least 1.8x the
fp32/TF32 reference; resnet18 at 32x32 faster with --compile than without; at world size 2, every script at least
0.95 of its reference, with the same weights. A configuration whose budget would end past --deadline is not started,
and named: `--part bench --configs 3` runs it alone in a second command.

--dry-run runs the same code on the CPU: the tests with GPU_TESTS_DEVICE=cpu (the ones that need a GPU skip), the
bench configurations with the cnn on 3x32x32 images for 3 steps. Its numbers measure nothing; it is there so that a
mistake shows up in CI and not in a GPU machine's minutes.
"""
import argparse
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks", "bench.py")

import torch  # noqa: E402

# (name, bench.py flags, budget in seconds). resnet50's synthetic data (25 steps x 128 images of 3x224x224, 1.9 GB)
# is built afresh by every run, so its runs are few and short; the budgets add up to 470 s, under --deadline's 480.
# A first repeat may outrun its budget (one always runs); the configurations that would then end past --deadline are
# named, to be run with --configs. Measured once, on an H200 (2026-11-27): a resnet50 run took about 24 s from launch
# to exit, so one repeat of configuration 0 (11 runs) about 265 s; the tests part did not end within 285 s
R50 = ["--model", "resnet50", "--shape", "3x224x224", "--batch-size", "128", "--steps", "25", "--val-size", "128"]
R18 = ["--model", "resnet18", "--shape", "3x32x32", "--batch-size", "256", "--steps", "100"]
CONFIGS = [
    ("resnet50 fp32/TF32", R50 + ["--world-sizes", "1"], 180),
    ("resnet50 bf16 channels-last", R50 + ["--world-sizes", "1", "--precision", "bf16", "--channels-last",
                                           "--scripts", "ddp_amp_train.py"], 60),
    ("resnet18 32x32 eager", R18 + ["--world-sizes", "1", "--scripts", "ddp_launch_train.py"], 40),
    ("resnet18 32x32 --compile", R18 + ["--world-sizes", "1", "--scripts", "ddp_launch_train.py", "--compile"], 90),
    ("resnet18 32x32, 2 processes on one GPU (gloo)", R18 + ["--world-sizes", "2", "--deterministic"], 100),
]
# --jobs 2 splits the tests by -k into these and the rest; the tests that share runs (test_gpu.py's `runs`) together
FIRST_JOB = "default_run or channels_last or amp_bf16 or fp16_loss or visible_devices or no_host_sync"
DRY_RUN = {"--model": "cnn", "--shape": "3x32x32", "--batch-size": "8", "--steps": "3", "--val-size": "8"}


def machine(dry_run):
    import torchvision
    return {"gpu": "none: dry run on the CPU" if dry_run else torch.cuda.get_device_name(0),
            "torch": torch.__version__, "torchvision": torchvision.__version__, "cuda": torch.version.cuda,
            "cpu_cores": len(os.sched_getaffinity(0)),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "dry_run": dry_run}


def header(m):
    return (f"GPU: {m['gpu']}; torch {m['torch']}, torchvision {m['torchvision']}, CUDA {m['cuda']}; "
            f"{m['cpu_cores']} CPU cores; {m['date']}"
            + ("; DRY RUN on the CPU: no measurement" if m["dry_run"] else ""))


def write(out, name, report, markdown):
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump(report, f, indent=1)
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write(markdown + "\n")
    print(f"\nwrote {os.path.join(out, name + '.json')} and {name}.md")


# ---- the tests
def part_tests(a, m):
    """tests/test_gpu.py under pytest, in --jobs processes side by side (a GPU is far from busy with these runs);
    every test's outcome, time and recorded numbers from their JUnit XML."""
    env = {**os.environ, "GPU_TESTS_DEVICE": "cpu" if a.dry_run else "cuda"}
    jobs, procs, t0 = [FIRST_JOB, f"not ({FIRST_JOB})"] if a.jobs == 2 else [None], [], time.time()
    # pytest's temporary folders, where the tests' processes get their TMPDIR, short: multiprocessing puts its
    # sockets there, whose paths end at 107 bytes (under a deep --out, DataLoader workers fail to hand over batches)
    short = tempfile.mkdtemp(prefix="gpu-tests-", dir="/tmp" if os.path.isdir("/tmp") else None)
    for i, k in enumerate(jobs):
        if os.path.exists(f"{a.out}/tests-{i}.xml"):  # an earlier run's: never read as this one's
            os.remove(f"{a.out}/tests-{i}.xml")
        cmd = [sys.executable, "-m", "pytest", "--full", "-n", "0", "tests/test_gpu.py", "-v", "-rfEs", "-p",
               "no:cacheprovider",
               f"--junitxml={a.out}/tests-{i}.xml", "-o", "junit_family=xunit1", f"--basetemp={short}/{i}"]
        cmd += ["-k", k] if k else []
        log = open(os.path.join(a.out, f"tests-{i}.log"), "w")
        print(f"pytest {' '.join(cmd[3:])}  > {log.name}", flush=True)
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for p, log in procs:
        try:
            codes.append(p.wait(timeout=max(1, a.timeout - (time.time() - t0))))
        except subprocess.TimeoutExpired:  # Ctrl-C's way: pytest then reports what failed and writes its XML
            p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
            codes.append("timed out")
        log.close()
        with open(log.name) as f:
            print(f"\n--- {log.name} (its end):\n" + "".join(f.readlines()[-25:]), end="")
    elapsed = time.time() - t0
    shutil.rmtree(short, ignore_errors=True)
    tests = [t for i in range(len(jobs)) if os.path.exists(f"{a.out}/tests-{i}.xml")
             for t in read_junit(f"{a.out}/tests-{i}.xml")]
    ok = codes == [0] * len(jobs)
    report = {"machine": m, "jobs": jobs, "exit_codes": codes, "elapsed_s": elapsed, "tests": tests}
    count = {o: sum(t["outcome"] == o for t in tests) for o in ("passed", "failed", "error", "skipped")}
    lines = [f"# tests/test_gpu.py: {header(m)}", "",
             f"`python benchmarks/gpu_report.py --part tests` ({len(jobs)} pytest processes side by side): "
             f"{'all done' if ok else f'FAILED (exit {codes})'} in {elapsed:.0f} s (the target: under 360 s); "
             f"{count['passed']} passed, {count['failed'] + count['error']} failed, {count['skipped']} skipped", "",
             "| test | outcome | s | recorded |", "|---|---|---|---|"]
    for t in tests:
        rec = ", ".join(f"{k} {v}" for k, v in t["recorded"].items())
        why = f": {t['message'][:200]}" if t["message"] else ""
        cells = [f"`{t['name']}`", t["outcome"] + why, f"{t['time_s']:.1f}", rec]
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    write(a.out, "tests", report, "\n".join(lines))
    print(f"\nwhere the {elapsed / 60:.1f} minutes went ({len(jobs)} processes side by side):")
    for t in sorted(tests, key=lambda t: -t["time_s"]):
        print(f"  {t['time_s']:6.1f} s  {t['outcome']:7}  {t['name']}")
    return ok


def read_junit(path):
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            e = case.find(kind)
            if e is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                message = e.get("message") or (e.text or "")
                break
        recorded = {p.get("name"): p.get("value") for p in case.iter("property")}
        tests.append({"name": case.get("name"), "outcome": outcome, "message": message.strip(),
                      "time_s": float(case.get("time") or 0), "recorded": recorded})
    return tests


# ---- the benchmark
def part_bench(a, m):
    """Each configuration through benchmarks/bench.py (each script against its reference), then the targets."""
    results, spent, skipped, failed, t_start = [], [], [], [], time.time()
    for i, (name, flags, budget) in enumerate(CONFIGS):
        if i not in a.configs:
            continue
        if time.time() - t_start + budget > a.deadline:  # its first repeat may take longer than its budget: not ...
            skipped.append(name)  # ... started where even the budget would not fit the command's time
            print(f"\n== {name}: not started, {time.time() - t_start:.0f} s of --deadline {a.deadline:.0f} s gone: "
                  f"run it alone with --configs {i}", flush=True)
            continue
        if a.dry_run:  # the same flags, small: the cnn on small images, a few steps, one repeat
            flags, name = [DRY_RUN.get(prev, f) for prev, f in zip([None] + flags, flags)], name + " [dry run: cnn]"
            budget = 1
        path = os.path.join(a.out, f"bench-{i}.json")
        cmd = [sys.executable, BENCH, "--device", "cpu" if a.dry_run else "cuda", "--repeats", str(a.repeats),
               "--budget", str(budget), "--timeout", str(a.run_timeout), "--json", path, *flags]
        print(f"\n== {name}: {' '.join(cmd[1:])}", flush=True)
        if os.path.exists(path):  # an earlier run's: never read as this one's
            os.remove(path)
        t0 = time.time()
        try:  # stopped at --deadline: its JSON holds the repeats that ended (bench.py writes it after each)
            code = subprocess.run(cmd, cwd=ROOT, timeout=max(1, a.deadline - (t0 - t_start))).returncode
        except subprocess.TimeoutExpired:
            code = "stopped at --deadline"
        spent.append((name, time.time() - t0, budget))
        if code != 0:  # 1: weights that differ from the reference's, its table written all the same
            print(f"{name}: benchmarks/bench.py exited {code}", file=sys.stderr)
            failed.append(name)
        if not os.path.exists(path):
            continue
        with open(path) as f:
            results += [{"config": name, "config_index": i, **row} for row in json.load(f)]
    targets = judge(results)
    report = {"machine": m, "configs": [{"name": n, "flags": f, "budget_s": b} for n, f, b in CONFIGS],
              "rows": results, "targets": targets, "spent_s": {n: s for n, s, _ in spent}, "not_started": skipped,
              "failed": failed}
    lines = [f"# GPU benchmark: {header(m)}", "",
             "`python benchmarks/gpu_report.py --part bench` (benchmarks/bench.py per configuration: medians of the "
             "repeats that fit its budget, each script run divided by the mean of the runs of its reference, started "
             "the same way, around it; weights checked equal).", "",
             "| configuration | run | world size | samples/s (median) | ratio to its reference (median) | range | "
             "repeats | start-up s | peak MB | weights |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        spread = f"{min(r['ratio_runs']):.2f}–{max(r['ratio_runs']):.2f}" if r["ratio_runs"] else "–"
        weights = r["verdict"]["weights"] if "verdict" in r else "–"
        lines.append(f"| {r['config']} | `{r['launch']}` | {r['world_size']} | {r['samples_per_s']:.0f} | "
                     f"{r['ratio']:.2f} | {spread} | {r['repeats']} | {r['startup_s']:.1f} | {r['peak_mem_mb']:.0f} | "
                     f"{weights} |")
    lines += [f"\nNot started (the command's --deadline): {', '.join(skipped)}"] if skipped else []
    lines += [f"\nbenchmarks/bench.py exited non-zero: {', '.join(failed)}"] if failed else []
    lines += ["", "Targets:", ""] + [f"- {t['target']}: {t['value']} — **{t['verdict']}**" for t in targets]
    write(a.out, "bench", report, "\n".join(lines))
    print(f"\nwhere the {sum(s for _, s, _ in spent) / 60:.1f} minutes went:")
    for name, s, budget in spent:
        print(f"  {s:6.1f} s  {name} (budget {budget} s for its repeats)")
    return not failed and {r["config_index"] for r in results} == set(a.configs) and \
        all(r["samples_per_s"] > 0 for r in results)


def judge(rows):
    """The four targets, from the rows that were measured ('not measured' where a configuration is missing)."""
    def speed(config, name, world_size=1):
        found = [r["samples_per_s"] for r in rows
                 if r["config_index"] == config and r["name"] == name and r["world_size"] == world_size]
        return found[0] if found else None

    def target(text, value, ok, shown):
        return {"target": text, "value": shown if value is not None else "not measured",
                "verdict": "not measured" if value is None else "met" if ok else "NOT met"}

    def lowest(scripts):
        worst = min(scripts, key=lambda r: r["ratio"]) if scripts else None
        return (worst["ratio"], f"lowest median {worst['ratio']:.2f} ({worst['name']} x{worst['world_size']})") \
            if worst else (None, "")
    scripts = [r for r in rows if r["config_index"] == 0 and r["name"] != r["reference"]]
    two = [r for r in rows if r["config_index"] == 4 and r["name"] != r["reference"]]
    (low, shown), (low2, shown2) = lowest(scripts), lowest(two)
    unequal = [f"{r['name']} x2" for r in two if not r["verdict"]["weights"].startswith("met")]
    fp32, bf16, amp = speed(0, "ddp-torchrun"), speed(1, "ddp-torchrun"), speed(1, "ddp_amp_train.py")
    eager, compiled = speed(2, "ddp_launch_train.py"), speed(3, "ddp_launch_train.py")
    ref_eager, ref_compiled = speed(2, "ddp-torchrun"), speed(3, "ddp-torchrun")
    amp_x = amp / fp32 if amp and fp32 else None
    compile_x = compiled / eager if compiled and eager else None
    return [
        target("every script at least 0.95 of its reference (resnet50, 224x224, fp32/TF32)", low,
               low is not None and low >= 0.95, shown),
        target("ddp_amp_train.py bf16 + channels-last at least 1.8x the fp32/TF32 reference", amp_x,
               amp_x is not None and amp_x >= 1.8,
               f"{amp_x:.2f}x (the reference in bf16 + channels-last: {bf16 / fp32:.2f}x)" if amp_x and bf16 else ""),
        target("ddp_launch_train.py resnet18 at 32x32 faster with --compile", compile_x,
               compile_x is not None and compile_x > 1,
               f"{compile_x:.2f}x eager (its reference: {ref_compiled / ref_eager:.2f}x)"
               if compile_x and ref_eager and ref_compiled else ""),
        target("2 processes on one GPU (gloo): every script at least 0.95 of its reference, weights equal", low2,
               low2 is not None and low2 >= 0.95 and not unequal,
               shown2 + (f"; weights not equal: {', '.join(unequal)}" if unequal else "")),
    ]


def main(a):
    if not a.dry_run and not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU here: run this on a GPU machine, or --dry-run to check it on the CPU")
    os.makedirs(a.out, exist_ok=True)
    m, ok, t0 = machine(a.dry_run), True, time.time()
    print(header(m), flush=True)
    if a.part in ("tests", "both"):
        ok &= part_tests(a, m)
    if a.part in ("bench", "both"):
        ok &= part_bench(a, m)
    print(f"\nall: {(time.time() - t0) / 60:.1f} minutes; {'done' if ok else 'FAILED (see above)'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["tests", "bench", "both"], help="default: both with --dry-run; else required")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "gpu_report"), help="folder for the JSON and Markdown")
    p.add_argument("--dry-run", action="store_true", help="on the CPU, small: checks the report and the tests")
    p.add_argument("--repeats", type=int, default=5, help="bench: at most this many repeats per configuration")
    p.add_argument("--jobs", type=int, choices=[1, 2], default=2, help="tests: pytest processes side by side")
    p.add_argument("--timeout", type=float, default=540, help="tests: seconds for the whole pytest run")
    p.add_argument("--run-timeout", type=float, default=240, help="bench: seconds for any one run of a script")
    p.add_argument("--configs", default=",".join(map(str, range(len(CONFIGS)))),
                   help="bench: which configurations, by number (0: resnet50 fp32, 1: bf16 channels-last, 2: resnet18 "
                   "eager, 3: --compile, 4: 2 processes on one GPU)")
    p.add_argument("--deadline", type=float, default=480, help="bench: no configuration is started whose budget "
                   "would end past this many seconds (the rest are named, to be run with --configs)")
    args = p.parse_args()
    args.part = args.part or ("both" if args.dry_run else None)
    try:
        args.configs = sorted({int(c) for c in args.configs.split(",")})
        assert set(args.configs) <= set(range(len(CONFIGS)))
    except (ValueError, AssertionError):
        p.error(f"--configs: numbers from 0 to {len(CONFIGS) - 1}, comma-separated")
    if args.part is None:
        p.error("--part tests or --part bench (each fits a 10-minute command), or --dry-run")
    main(args)
