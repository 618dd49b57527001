"""The `anyseek` command. Each subcommand lives in its own module as two plain functions:

    configure(parser: argparse.ArgumentParser) -> None   # add its arguments
    run(args: argparse.Namespace, extra: list[str]) -> int   # do the work, return an exit code

`extra` holds arguments argparse did not know (used by `train` for `--section.key=value` overrides).
Modules are imported only when their subcommand runs, so `anyseek --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("anyseek.train.cli", "train a model (default: tiny flavor on the built-in Wikipedia sample)"),
    "prepare": ("anyseek.data.cli_prepare", "turn a text source into token shards and a tokenizer"),
    "data": ("anyseek.data.cli_data", "inspect prepared data (`anyseek data inspect DIR`)"),
    "generate": ("anyseek.infer.cli", "generate text from a checkpoint (streams; --prompts FILE.jsonl; --interactive)"),
    "serve": ("anyseek.infer.serve", "an OpenAI-compatible server, continuous batching (anyseek[serve])"),
    "eval": ("anyseek.infer.cli_eval", "loss and perplexity of a checkpoint on prepared data"),
    "export": ("anyseek.checkpoint.cli", "write a Hugging Face folder from a checkpoint (sharded, LoRA merged; --peft)"),
    "doctor": ("anyseek.doctor", "report what this machine supports and which kernels will run"),
    "plan": ("anyseek.train.plan", "memory per GPU and communication for a config on N GPUs; suggests EP degree"),
}


def _load(name: str):
    module, _ = COMMANDS[name]
    return importlib.import_module(module)


def build_parser(load_modules: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="anyseek", description="Train and run DeepSeek-V3-style models anywhere.")
    from anyseek import __version__

    parser.add_argument("--version", action="version", version=f"anyseek {__version__}")
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks for errors (or ANYSEEK_DEBUG=1)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == load_modules:
            _load(name).configure(p)
    return parser


# Errors a user makes (bad input, a missing GPU, a full disk): one `error:` line, no traceback (--debug shows it).
def _user_errors() -> tuple[type[BaseException], ...]:
    from anyseek.storage import CheckpointError

    return (ValueError, OSError, RuntimeError, KeyError, CheckpointError)


def _one_line_warnings() -> None:
    """anyseek's own warnings (warnings.warn, for Python callers) as one `warning: ...` line on the command line:
    their messages name the file and the problem, and Python's default adds the warning's source file and line
    (`.../init.py:113: UserWarning: ...` and the line of code), which tells a user nothing. Other packages'
    warnings keep Python's format."""
    if getattr(warnings.formatwarning, "anyseek", False):
        return
    package = os.path.dirname(os.path.abspath(__file__))
    python_format = warnings.formatwarning

    def formatwarning(message, category, filename, lineno, line=None) -> str:
        if os.path.abspath(filename).startswith(package + os.sep):
            return f"warning: {message}\n"
        return python_format(message, category, filename, lineno, line)

    formatwarning.anyseek = True
    warnings.formatwarning = formatwarning


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("ANYSEEK_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    if not debug:
        _one_line_warnings()
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `anyseek data inspect --json | head`: the reader left; say nothing
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115  silence the flush at exit
        except OSError:
            pass
        return 0
    except _user_errors() as e:
        if debug:
            raise
        msg = str(e) if not isinstance(e, KeyError) else f"missing key {e}"
        if isinstance(e, OSError) and e.filename and str(e.filename) not in msg:
            msg = f"{e.filename}: {e.strerror or msg}"
        # one write of the whole line: under torchrun every rank shares this stderr, and print's two writes
        # (the text, then the newline) let two ranks' lines run into one
        sys.stderr.write(f"error: {msg.strip()}" + ("" if "\n" in msg else "  (--debug shows the traceback)") + "\n")
        sys.stderr.flush()
        return 2


def _main(argv: list[str]) -> int:
    command = next((a for a in argv if not a.startswith("-")), None)
    if command not in COMMANDS:
        command = None
    parser = build_parser(load_modules=command)
    if command is None:
        args = parser.parse_args(argv)  # prints help / version / an error for an unknown command
        parser.print_help()
        return 0
    args, extra = parser.parse_known_args(argv)
    module = _load(command)
    if extra and not getattr(module, "ACCEPTS_EXTRA", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return int(module.run(args, extra) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
