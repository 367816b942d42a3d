"""``python -m edurl.serve --host 127.0.0.1 --port PORT --api-key KEY``: serve the Tinker API until stopped."""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import threading


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: loopback only if every address it resolves to is
        try:
            infos = socket.getaddrinfo(host, None)
        except OSError:
            return False
        return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def resolve_key(host: str, api_key: str | None) -> tuple[str, bool]:
    """The key to require, and whether it was made up here. A non-loopback address needs a key of your own."""
    key = api_key or os.environ.get("EDURL_SERVE_API_KEY")
    if key:
        if not key.startswith("tml-"):
            raise SystemExit("edurl.serve: the API key must start with 'tml-' (the tinker SDK refuses other keys)")
        return key, False
    if not is_loopback(host):
        raise SystemExit(
            f"edurl.serve: refusing to listen on {host} without an API key; pass --api-key tml-... "
            "or set EDURL_SERVE_API_KEY (or bind to 127.0.0.1)"
        )
    return "tml-" + secrets.token_urlsafe(24), True


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 1 to 65535, got {port}")
    return port


def _megabytes(text: str) -> float:
    """--max-body-mb: a finite number above 0 (0 or less refused every request, inf and nan ended in a traceback)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of MiB") from None
    if not math.isfinite(value) or value <= 0 or int(value * 2**20) < 1:
        raise argparse.ArgumentTypeError(f"the body limit must be a finite number of MiB above 0, got {text!r}")
    return value


def refuse(message: str) -> None:
    """Stop before any work with ``error: message`` and exit status 2, as a bad flag does (and the recipes)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


class _Terminated(Exception):
    """SIGTERM arrived: unwinds main() so that its clean-up runs (the default action ends the process at once)."""


def _terminated(signum, frame) -> None:
    raise _Terminated(signum)


def _check_free(host: str, port: int) -> None:
    """Exit (status 3, as uvicorn does) with the reason when ``host:port`` cannot be bound, e.g. a server already
    listens there; a bind that uvicorn's own options allow passes."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # bound as uvicorn binds, through asyncio, which sets SO_REUSEADDR only on posix: there it just skips
        # TIME_WAIT, but on Windows it would let the probe bind a port another server listens on, and uvicorn fail
        # after loading. Elsewhere a plain bind, as asyncio's (SO_EXCLUSIVEADDRUSE would refuse more than it does)
        if os.name == "posix":
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as err:
            print(
                f"edurl.serve: cannot listen on {host}:{port} ({err.strerror or err}); is another server running "
                "there? Pick another --port, or stop that one.",
                file=sys.stderr,
            )
            raise SystemExit(3) from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m edurl.serve", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=_port, default=8000, help="TCP port to listen on (1 to 65535; default 8000)")
    parser.add_argument("--api-key", default=None, help="the key clients must send (tml-...); or EDURL_SERVE_API_KEY")
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: edurl.device())")
    parser.add_argument("--state-dir", default=None, help="where save_state writes checkpoints (default: a temp dir)")
    parser.add_argument(
        "--max-body-mb", type=_megabytes, default=64.0, help="largest request body accepted (MiB, above 0)"
    )
    parser.add_argument(
        "--preload",
        action="append",
        default=[],
        metavar="MODEL",
        help="load (or train and cache) this base model before serving; repeatable. Without it a model loads on "
        "first use, and edurl/tiny-arithmetic trains on first use if it is not cached (about 1.5 min on 2 cores)",
    )
    args = parser.parse_args(argv)
    key, generated = resolve_key(args.host, args.api_key)
    # what would fail only later, inside the first request (a device) or the first save_state (a state folder that
    # is a file), stops the server here, before any model loads
    if args.device is not None:
        from edurl.utils import device

        try:
            device(args.device)
        except ValueError as exc:
            refuse(f"--device {args.device}: {exc}")
    if args.state_dir is not None:
        from edurl.utils import file_in_the_way

        clash = file_in_the_way(args.state_dir)
        if clash is not None:
            refuse(f"--state-dir {args.state_dir}: {clash}; pass a folder (it is made if missing)")
    _check_free(args.host, args.port)  # before any model loads, and before "serving" is printed
    try:
        import uvicorn

        from edurl.serve import ModelRegistry, create_app
    except ImportError as exc:
        raise SystemExit(
            f"edurl.serve needs the tinker extra (Python >= 3.11): pip install -e '.[tinker]' ({exc})"
        ) from None
    models = ModelRegistry(device=args.device)
    for name in args.preload:
        print(f"edurl.serve: loading {name} ...", file=sys.stderr, flush=True)
        models.load(name)
    # Without --state-dir the folder is made here and removed in the finally below. An exit hook would not run on
    # SIGTERM: uvicorn shuts down, then raises the signal again, whose default action ends the process at once.
    # So SIGTERM gets a handler that unwinds main(), and is raised again after the clean-up (the exit status
    # stays that of a process ended by SIGTERM).
    made = None if args.state_dir is not None else tempfile.mkdtemp(prefix="edurl-serve-")
    terminated = False
    main_thread = threading.current_thread() is threading.main_thread()  # only there can a handler be set
    previous = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        app = create_app(
            key,
            models=models,
            state_dir=args.state_dir if made is None else made,
            max_body_bytes=int(args.max_body_mb * 2**20),
        )
        if generated:
            print(f"edurl.serve: no --api-key given; clients must send this one: {key}", file=sys.stderr, flush=True)
        print(f"edurl.serve: serving the Tinker API on http://{args.host}:{args.port}", file=sys.stderr, flush=True)
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    except _Terminated:
        terminated = True
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
    if terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)


if __name__ == "__main__":
    main()
