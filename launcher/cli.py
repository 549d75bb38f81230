"""What every command line shares: `--help`, `--cfg job|all`, `--info`, the multirun answer, the
one way a failing process reports and exits, and SIGTERM handled as SIGINT where servers run.

The commands compose their config with hydra's compose API (every rank under torchrun composes
it alone), so hydra's own `@hydra.main` flags are provided here, in the same words.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import sys
import time
from datetime import timedelta

from launcher.config import CONF_DIR, compose_config, config_yaml, schema
from launcher.parent_death import die_with_parent

log = logging.getLogger("dflash")
PEER_REPORT_TIMEOUT_S = 15.0


# ----------------------------------------------------------------------------------- flags
def _keys(node_type, prefix=""):
    """(key, type, default, doc) of every knob of a schema dataclass, depth first."""
    for spec in dataclasses.fields(node_type):
        if dataclasses.is_dataclass(spec.default_factory):
            yield from _keys(spec.default_factory, f"{prefix}{spec.name}.")
            continue
        default = spec.default_factory() if spec.default_factory is not dataclasses.MISSING else spec.default
        rules = {k: v for k, v in spec.metadata.items() if k not in ("doc", "each")}
        yield f"{prefix}{spec.name}", str(spec.type), default, spec.metadata.get("doc", ""), rules


def help_text(config_name: str, usage: str, about: str | None = None) -> str:
    """`about`: the command's one paragraph (default: its config root's, e.g. launcher.train's)."""
    root = schema.ROOTS[config_name]
    groups = []
    for group in sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir()):
        if any(spec.name == group for spec in dataclasses.fields(root)):
            options = sorted(f.stem for f in (CONF_DIR / group).glob("*.yaml"))
            groups.append(f"  {group}: {', '.join(options)}")
    lines = [(about or root.__doc__).strip(), "", usage.strip(), "", "Config groups (pick one: group=option):",
             *groups, "",
             "Keys (override with key=value; defaults from launcher/config/schema.py before the group option):"]
    for key, kind, default, doc, rules in _keys(root):
        shown = ("non-empty" if name == "nonempty" else f"{name} {value}" for name, value in rules.items())
        allowed = f" [{', '.join(shown)}]" if rules else ""
        lines.append(f"  {key}={default!r}  ({kind.replace('Optional[', '').rstrip(']')}){allowed}\n      {doc}")
    lines += ["", "Flags: --help | --cfg job (the composed config, then exit) | --cfg all (with hydra's own section) "
                  "| --info (where the config comes from)"]
    return "\n".join(lines)


def parse_flags(argv: list[str], config_name: str, usage: str, about: str | None = None) -> list[str]:
    """Handle the flags (printing and exiting 0); return the overrides."""
    if any(arg in ("-m", "--multirun") for arg in argv):
        raise SystemExit("error: --multirun is not supported: a drafter job owns its GPUs and run.dir; launch one "
                         "job per setting instead, e.g. `for s in 100 200; do torchrun ... train.steps=$s "
                         "run.dir=runs/sweep/$s; done`")
    if "-h" in argv or "--help" in argv:
        print(help_text(config_name, usage, about))
        raise SystemExit(0)
    if "--info" in argv:
        print(f"config: {CONF_DIR / (config_name + '.yaml')} on top of {schema.ROOTS[config_name].__name__} "
              f"(launcher/config/schema.py)\ngroups: {CONF_DIR}/<group>/<option>.yaml\n"
              f"overrides: {[a for a in argv if a != '--info']}")
        raise SystemExit(0)
    if "--cfg" in argv:
        at = argv.index("--cfg")
        which = argv[at + 1] if at + 1 < len(argv) else None
        if which not in ("job", "all"):
            raise SystemExit("error: --cfg takes job or all")
        overrides = argv[:at] + argv[at + 2:]
        print(config_yaml(compose_config(overrides, config_name)), end="")
        if which == "all":
            print(f"hydra:\n  config_dir: {CONF_DIR}\n  config_name: {config_name}\n  overrides: {overrides}")
        raise SystemExit(0)
    unknown = [arg for arg in argv if arg.startswith("-")]
    if unknown:
        raise SystemExit(f"error: unknown flag {unknown[0]!r}; see --help")
    return argv


# ----------------------------------------------------------------------------------- failures
def _let_peers_report(timeout_s: float = PEER_REPORT_TIMEOUT_S) -> None:
    """Before any process group exists a config error hits every rank alike, but torchrun stops all
    workers as soon as one exits: wait (bounded) until every rank has reported its own failure,
    counted in torchrun's store."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world <= 1 or "MASTER_ADDR" not in os.environ:
        return
    import torch.distributed as dist
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=timedelta(seconds=5))
        key = f"dflash/failed_before_start/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while store.add(key, 0) < world and time.monotonic() < deadline:
            time.sleep(0.1)
    except (RuntimeError, OSError, ValueError):
        pass  # no agent store to meet at: exit now


def _record_for_torchrun(exc: BaseException) -> None:
    """What torchrun's @record does: the traceback goes to TORCHELASTIC_ERROR_FILE, so torchrun's
    failure summary names this rank's root cause (run_main catches the exception itself, to exit
    at once without a blocking process-group teardown)."""
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler
        handler = ErrorHandler()
        handler.initialize()
        handler.record_exception(exc)


def launch_under_torchrun(module: str, argv: list[str]) -> None:
    """Outside torchrun (`dflash-train ...` or `python -m launcher.train ...`), start torchrun on this
    host with one process per rank of the topology: `--nproc-per-node N` if given, else T + D of a
    `topology=t<T>d<D>` override, else one per GPU (at least 2)."""
    import torch
    args = [arg for arg in argv if not arg.startswith("--nproc-per-node")]
    given = [arg.split("=", 1)[1] for arg in argv if arg.startswith("--nproc-per-node=")]
    spec = next((arg.split("=", 1)[1] for arg in argv if arg.startswith("topology=")), "auto")
    if given:
        nproc = int(given[0])
    elif spec.startswith("t") and "d" in spec and spec[1:].replace("d", "").isdigit():
        nproc = sum(int(part) for part in spec[1:].split("d"))
    else:
        nproc = max(2, torch.cuda.device_count())
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", module, *args]
    print("launching: " + " ".join(command[1:]), flush=True)
    os.execv(sys.executable, command)


def report_failure(exc: BaseException) -> None:
    """This rank's failure, logged once with its role and rank (a traceback only where the cause is not
    a plain bad value or file), and recorded for torchrun's failure summary."""
    from hydra.errors import HydraException
    expected = isinstance(exc, (ValueError, OSError, HydraException))
    message = str(exc).splitlines()[0] if isinstance(exc, HydraException) else str(exc)
    if isinstance(exc, HydraException) and exc.__cause__ is not None:
        message += f" ({str(exc.__cause__).splitlines()[0]})"
    log.error("failed: %s: %s", type(exc).__name__, message, exc_info=not expected)
    _record_for_torchrun(exc)
    sys.stderr.flush()


def exit_failed(exc: BaseException) -> None:
    """Report `exc` and end this process at once, from any thread: a process group is alive, and its
    teardown can block (on a peer that stopped, forever)."""
    report_failure(exc)
    logging.shutdown()
    os._exit(1)


# ----------------------------------------------------------------------------------- signals
class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT, raised in the main thread (stop_on_signals) so that every `finally` runs and
    the servers a command started stop. `left`: what the command leaves and how to resume, set on the
    way out by the code that knows."""

    def __init__(self, signum: int, left: str = ""):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.left = signum, left


@contextlib.contextmanager
def stop_on_signals():
    """SIGTERM (what `timeout`, `kill` and job schedulers send) handled as SIGINT is: Stopped raised in the
    main thread, once (a second signal during the bounded teardown is ignored). The handlers before
    are restored on leaving."""
    stops = (signal.SIGTERM, signal.SIGINT)
    before = {stop: signal.getsignal(stop) for stop in stops}

    def handler(signum, frame):
        for stop in stops:
            signal.signal(stop, signal.SIG_IGN)
        raise Stopped(signum)

    for stop in stops:
        signal.signal(stop, handler)
    try:
        yield
    finally:
        for stop, previous in before.items():
            signal.signal(stop, previous)


def report_stopped(exc: KeyboardInterrupt) -> int:
    """Say that a signal stopped the command, and what it leaves; the exit code (128 + the signal)."""
    signum = getattr(exc, "signum", signal.SIGINT)
    left = getattr(exc, "left", "")
    log.warning("stopped by %s%s", signal.Signals(signum).name, f": {left}" if left else "")
    return 128 + signum


def run_main(run, config_name: str, usage: str, argv: list[str] | None = None, *, command: str | None = None,
             about: str | None = None) -> None:
    """Parse the flags, run `run(overrides)`, and on failure log it (role and rank in every line),
    let peers report too, and exit non-zero at once; SIGINT (or Stopped) is said in one line and exits
    128 + the signal. argv: default sys.argv[1:]. `command` tags the
    log lines and `about` opens --help, for a command that takes another's config (launcher.prepare
    takes launcher.train's); by default the config's. Under torchrun the process first asks the
    kernel to kill it when torchrun dies, whichever command it runs."""
    from launcher.run_io.rundir import setup_logging
    if "LOCAL_RANK" in os.environ:
        die_with_parent()
    if not log.handlers:
        setup_logging(command or (config_name if config_name != "config" else "train"), logging.INFO)
    try:
        code = run(parse_flags(sys.argv[1:] if argv is None else argv, config_name, usage, about))
    except BaseException as exc:  # every rank reports its own failure, then exits non-zero at once
        if isinstance(exc, SystemExit):
            raise
        import torch.distributed as dist
        distributed = dist.is_available() and dist.is_initialized()
        if isinstance(exc, KeyboardInterrupt):   # a signal, not a failure: no traceback
            code = report_stopped(exc)
            if distributed:
                logging.shutdown()
                os._exit(code)
            raise SystemExit(code) from None
        if distributed:
            exit_failed(exc)
        report_failure(exc)
        _let_peers_report()
        raise SystemExit(1) from None
    sys.exit(code)
