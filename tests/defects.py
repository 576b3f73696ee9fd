"""Planted defects: does the suite still catch them? Each defect is a small edit of a script, of common.py, of
failsafe.py or of an extra, of the kind a change could make by mistake. For each, a copy of the checkout is made in a
temporary folder, the edit is applied there (the text it replaces must be found exactly once), and a tier of the suite
runs against it, stopping at its first failure: that test caught the defect. A defect no test catches is a hole in the
suite.

    python tests/defects.py                  # every defect against the everyday tier (python -m pytest)
    python tests/defects.py --full           # against the full tier
    python tests/defects.py --only set_epoch --only scaler

Each run takes minutes (a tier runs until its first failure). docs/correctness.md lists the defects and the tests
that caught them."""
import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFECTS = {  # name: (file, [(a text of it, what it becomes), ...], what the defect is)
    "set_epoch": ("ddp_launch_train.py", [("    run.sampler.set_epoch(epoch)\n", "")],
                  "no sampler.set_epoch: every epoch repeats epoch 0's order"),
    "buffer_broadcast": ("ddp_launch_train.py", [("                dist.broadcast(buffer, src=0)\n",
                                                  "                pass\n")],
                         "the BatchNorm buffers not broadcast before the evaluation and the save"),
    "step_check": ("failsafe.py", [("            self.check()\n", "            pass\n")],
                   "the step's check gone: no NaN/inf stop, no stop signal acted on"),
    "resume_one_step_late": ("common.py", [(
        '        self.step_in_epoch = saved.get("samples_in_epoch", 0) // run.global_batch\n',
        '        self.step_in_epoch = (saved.get("samples_in_epoch", 0) // run.global_batch\n'
        '                              + bool(saved.get("samples_in_epoch")))\n')],
        "a mid-epoch resume one step late: a batch skipped"),
    "rng_restore": ("common.py", [("def restore_rng(saved, run):\n", "def restore_rng(saved, run):\n    return\n")],
                    "the random generators not restored on resume"),
    "scaler": ("ddp_amp_train.py", [('             "scaler": run.scaler.state_dict()}  # [amp] the loss scale\n',
                                     "             }\n")],
               "fp16's GradScaler state left out of last.pt"),
    "every_rank_prints": ("ddp_launch_train.py", [
        ("    master = run.rank == 0  # only rank 0 prints and writes files\n", "    master = True\n")],
        "every rank prints (and writes metrics.jsonl)"),
    "exit_1_on_bad_input": ("failsafe.py", [("    code = 2  # the user's: a flag, a launch, a file, the data\n",
                                           "    code = 1  # the user's: a flag, a launch, a file, the data\n")],
                            "bad input exits 1, not 2"),
    "non_atomic_save": ("common.py", [('        with open(tmp, "wb") as f:\n', '        with open(path, "wb") as f:\n'),
                                      ("        os.replace(tmp, path)\n", "")],
                        "last.pt written in place: a kill mid-save leaves a torn file"),
    "sigusr1_ignored": ("failsafe.py", [('for n in ("SIGUSR1", "SIGTERM", "SIGHUP", "SIGINT")',
                                       'for n in ("SIGTERM", "SIGHUP", "SIGINT")')],
                        "SIGUSR1 (a time limit near) not acted on"),
    "queue_threads_not_awaited": ("failsafe.py", [("            thread.join(timeout=1)\n", "            pass\n")],
                                  "the exit before the DataLoader queues' threads end: a leaked-semaphore warning"),
    "workers_start_hearing": ("failsafe.py", [(
        "        return start_deaf(super().__iter__)\n", "        return super().__iter__()\n")],
                              "DataLoader workers and their fork server started with the stop signals unblocked"),
    "spawn_tracker_hearing": ("ddp_spawn_train.py", [(
        "    failsafe.start_resource_tracker()  # the children's, deaf: a job's stop signal reaches it too\n", "")],
        "mp.spawn's parent starts its children's resource tracker hearing the stop signals"),
    "tracker_in_trainers_group": ("failsafe.py", [(
        "        spawn, util.spawnv_passfds = util.spawnv_passfds, spawn_in_own_session\n",
        "        spawn = util.spawnv_passfds\n")],
        "the resource tracker in the trainer's process group: a SIGKILL to it leaves semaphores in /dev/shm"),
    "process_group_freed": ("failsafe.py", [("            KEPT.append(dist.group.WORLD)\n", "")],
                            "the process group freed by the gc after a stop: now and then its destructor deadlocks"),
    "earlier_metrics_replaced": ("failsafe.py", [("    if logged and not (found or args.overwrite):", "    if False:")],
                                 "a fresh run rewrites an earlier run's metrics.jsonl whose checkpoint is gone"),
    "frozen_store_waited_on": ("train_extras/hangs.py", [("        arrived = within(10, lambda: mark_and_read(run))\n",
                                                          "        arrived = mark_and_read(run)\n")],
                               "a rank waits on the store of a frozen rank 0 for the socket's 10 minutes"),
    "tied_weights_in_two_groups": ("fsdp_train.py", [(
        "        if params and all(owners[p] == 1 for p in params) and \\\n", "        if params and \\\n")],
                                   "a tied parameter in two FSDP groups: fsdp_train.py refuses the model"),
    "dataset_normalize_taken": ("common.py", [('getattr(ds, "normalize_uint8", None)',
                                               'getattr(ds, "normalize", None)')],
                                "a Dataset's own `normalize` attribute called on uint8 batches"),
    "foreign_metrics_lines_ignored": ("failsafe.py", [(
        "    logged = [line for line, _ in metrics_lines(run) if line.strip()]",
        "    logged = [line for line, row in metrics_lines(run) if row]")],
        "a fresh run rewrites a metrics.jsonl whose lines are not the scripts' rows"),
    "foreign_metrics_lines_dropped": ("failsafe.py", [('if not row or row["epoch"] <= run.position.epoch',
                                                     'if row and row["epoch"] <= run.position.epoch')],
                                      "a resume drops the lines of metrics.jsonl that are not the scripts' rows"),
    "empty_validation_divides": ("common.py", [("    if not count:\n", "    if False:\n")],
                                 "an empty validation set: ZeroDivisionError after the epoch"),
    "damaged_checkpoint_read": ("failsafe.py", [("    if bad:\n", "    if False:\n")],
                                "a last.pt whose bytes changed after its save is read"),
    "damaged_shards_read": ("train_extras/sharded.py", [("    names = [n for n in sorted(saved)",
                                                         "    names = [] and [n for n in sorted(saved)")],
                            "a ckpt-<step> folder whose bytes changed after its save is read"),
    "pause_blames_a_rank": ("failsafe.py", [("        return time.monotonic() - self.continued < self.window + 30\n",
                                           "        return False\n")],
                            "a whole job paused longer than --step-timeout: a rank named frozen or gone"),
    "orphans_train_on": ("failsafe.py", [(
        "        if self.launcher and os.getppid() != self.launcher and not self.received:\n", "        if False:\n")],
        "workers whose torchrun is gone train on, with nobody to stop them"),
    "own_ending_named": ("train_extras/hangs.py", [("        if lost and missing and ended == missing:",
                                                     "        if False:")],
                         "a rank that ended with its own line named as gone by the peers that lose it"),
    "lost_peer_unnamed": ("train_extras/hangs.py", [("        lost = failsafe.peer_lost(why)", "        lost = False")],
                          "a rank killed outright: the others do not name it"),
    "joining_unbounded": ("failsafe.py", [("    timer.start()\n", "")],
                          "ranks that cannot join wait on a foreign listener, or for torch's timeouts"),
    "deep_tmpdir_sockets": ("failsafe.py", [("len(os.fsencode(tempfile.gettempdir())) > 70",
                                           "len(os.fsencode(tempfile.gettempdir())) > 10**6")],
                            "DataLoader workers' sockets under a deep TMPDIR: AF_UNIX path too long"),
    "ctrl_c_named_sigterm": ("ddp_spawn_train.py", [(
        "    failsafe.STOP.interrupted = interrupted  # its stop line names Ctrl-C, not the SIGTERM for it\n", "")],
        "Ctrl-C to ddp_spawn_train.py says it stopped by SIGTERM"),
    "hook_data_called": ("common.py", [('    if callable(getattr(ds, "batch_loader", None)):',
                                        '    if hasattr(ds, "batch_loader"):')],
                         "a Dataset's batch_loader attribute that is plain data is called"),
    "speed_of_nothing": ("common.py", [("global_batch / seconds if seconds > 0 else None",
                                        "global_batch / seconds if seconds > 0 else 0.0")],
                         "--max-steps 1 logs 0 samples/s, a speed it did not measure"),
    "sharded_advice_wrong": ("train_extras/sharded.py", [(
        '    if found and "last.pt" not in found and not hasattr(run.args, "ckpt_format"):', "    if False:")],
                             "a script that reads last.pt says --resume auto continues fsdp_train.py's folders"),
}


def planted(name, folder):
    """A copy of the checkout's tracked files in `folder`, with defect `name` applied."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        os.makedirs(os.path.join(folder, os.path.dirname(f)), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, f), os.path.join(folder, f))
    path, edits, _ = DEFECTS[name]
    text = open(os.path.join(folder, path)).read()
    for old, new in edits:
        if text.count(old) != 1:
            raise SystemExit(f"{name}: the text to replace is in {path} {text.count(old)} times, not once")
        text = text.replace(old, new)
    with open(os.path.join(folder, path), "w") as f:
        f.write(text)


def first_failure(output):
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ")[0]
    if "the tests left these behind, which fails the run" in output:  # (conftest.py's check after the session)
        return "the session's check of what the tests left behind"
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="the full tier (default: the everyday one)")
    parser.add_argument("--only", action="append", choices=sorted(DEFECTS), help="these defects only")
    parser.add_argument("--pytest-args", default="", help="more arguments for pytest (e.g. a test's path first)")
    args = parser.parse_args()
    missed = []
    for name in args.only or DEFECTS:
        with tempfile.TemporaryDirectory(prefix=f"defect-{name}-") as folder:
            planted(name, folder)
            cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                   *(["--full"] if args.full else []), *args.pytest_args.split()]
            t = time.monotonic()
            p = subprocess.run(cmd, cwd=folder, capture_output=True, text=True)
            caught = first_failure(p.stdout) if p.returncode != 0 else None
            print(f"{name}: {'caught by ' + caught if caught else 'NOT CAUGHT'} ({time.monotonic() - t:.0f} s)"
                  f"  [{DEFECTS[name][2]}]", flush=True)
            if not caught:
                missed.append(name)
                print(p.stdout[-2000:], flush=True)
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
