"""Frontier: train language models from scratch under a fixed wall-clock budget."""
import atexit
import gc
import os
import signal
import sys


def load_for_eval(checkpoint_path, device="cpu"):
    """The competition's evaluation interface; see frontier.checkpoint.load_for_eval."""
    from frontier.checkpoint import load_for_eval as load

    return load(checkpoint_path, device)


def _started_as_a_command() -> bool:
    """`python -m frontier.<command>` or a `frontier-<command>` script (sys.orig_argv: Python 3.10+)."""
    argv = getattr(sys, "orig_argv", [])
    for i, arg in enumerate(argv[1:], 1):
        if arg.startswith("-m"):
            module = arg[2:] or (argv[i + 1] if i + 1 < len(argv) else "")
            return module.split(".")[0] == "frontier"
        if arg == "-c" or not (arg.startswith("-") or argv[i - 1] in ("-X", "-W")):
            break  # Python's own options end here: the rest are a script's or a program's
    return os.path.basename(sys.argv[0] if sys.argv else "").startswith("frontier-")


def _interrupted_while_starting(signum, frame) -> None:
    """Ctrl-C or SIGTERM while a command imports its libraries, before frontier.cli.command handles
    them: a KeyboardInterrupt there is a traceback from deep inside an import (or, half-way through
    numpy's, a RecursionError), SIGTERM's default a silent exit 143, and there is nothing to end but
    the process."""
    os.write(2, b"interrupted\n")
    os._exit(130)


def startup_over() -> None:
    """A command's start-up is over: Python's collector, off since the command started, collects once
    (the configs a grid's checks composed are garbage in cycles), then watches what the work makes from
    here and no longer walks what start-up built (gc.freeze: the imports' objects, the model, the config).
    Start-up makes hundreds of thousands of objects and little garbage; collecting meanwhile walked them
    again and again, about a fifth of a short run's CPU. Called when a run's first step begins, when a
    sweep's driver starts its trials, and when a side command starts its work; outside a command, and
    after the first call, it does nothing. At exit the frozen objects are handed back, so that Python's
    shutdown frees them (frozen, triton's bindings report them leaked)."""
    if _started_as_a_command() and not gc.isenabled():
        gc.collect()
        gc.freeze()
        gc.enable()
        atexit.register(gc.unfreeze)


STARTING_DEFAULTS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}

if _started_as_a_command():
    gc.disable()  # until startup_over()
    for _signum, _default in STARTING_DEFAULTS.items():
        if signal.getsignal(_signum) is _default:  # not one a parent chose to ignore
            signal.signal(_signum, _interrupted_while_starting)


__all__ = ["load_for_eval"]
