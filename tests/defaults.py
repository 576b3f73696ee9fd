"""`python -S defaults.py CMD...`: CMD with the stop signals at their defaults, as a terminal starts a command. A shell
that runs the tests in the background, or under nohup, ignores some of them, and an ignored signal stays ignored in
every process started from it (processes.Proc starts every real command through this)."""
import os
import signal
import sys

for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGQUIT"):
    if hasattr(signal, name):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
os.execvp(sys.argv[1], sys.argv[1:])
