"""Start a vLLM server that `lit_ess.engines.VLLMServerConfig(urls=[...])` can use, on any machine,
with exactly the flags of the server lit-ess launches itself (`server_launch.server_command`); prints
its URL when it answers /health and runs until Ctrl-C or SIGTERM, which stop it. A port another
process holds is refused, naming it; a host other machines reach needs the fleet's shared token:

    python -m lit_ess.engines.serve --model runs/demo/sft/model --port 8000 [extra vLLM flags]
    LIT_ESS_SERVER_TOKEN=<secret> python -m lit_ess.engines.serve --model runs/demo/sft/model --port 8000 --host 10.0.0.5
"""
from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from pathlib import Path

from .guard import TOKEN_ENV
from .server_launch import launch
from .vllm_server import VLLMServerConfig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lit_ess.engines.serve",
                                description="Start a vLLM server for lit-ess's VLLMServerConfig(urls=[...]); "
                                            "flags it does not know pass through to vLLM.")
    p.add_argument("--model", required=True, help="the model folder the trainer starts from (model.model_path)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1",
                   help=f"interface to listen on; any but loopback needs the shared secret {TOKEN_ENV} in the "
                        f"environment, here and where the trainer runs (every route but /health wants it)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "auto"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--max-lora-rank", type=int, default=None,
                   help="serve LoRA adapters up to this rank, loaded at run time (model.lora.sync: adapter)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--log-file", default=None, help="server output (default: a file in the temp folder)")
    args, extra = p.parse_known_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        p.error(f"--model {args.model}: no config.json there (a Hugging Face model folder, e.g. runs/demo/sft/model)")
    try:
        c = VLLMServerConfig(dtype=args.dtype, max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib,
                             gpu_memory_utilization=args.gpu_memory_utilization, port=args.port, server_args=extra,
                             max_lora_rank=args.max_lora_rank)
    except ValueError as e:
        p.error(str(e))
    try:                                # a port taken, a host other machines reach without the shared token
        server = launch(args.model, c, args.host, args.port, args.log_file, serve=True)
    except ValueError as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))           # SIGTERM stops the server as Ctrl-C does
    wildcard = args.host in ("0.0.0.0", "::", "")
    url = f"http://{socket.gethostname() if wildcard else args.host}:{args.port}"     # what other machines name
    try:
        seconds = server.wait_ready(args.startup_timeout)
        guarded = f"clients send ${TOKEN_ENV}; " if os.environ.get(TOKEN_ENV) else ""
        print(f"ready in {seconds:.0f} s: {url}   ({guarded}engine: {{class_path: lit_ess.engines.VLLMServerConfig, "
              f"init_args: {{urls: [{url}], dtype: {args.dtype}"
              f"{f', max_lora_rank: {args.max_lora_rank}' if args.max_lora_rank else ''}}}}})", flush=True)
        return server.proc.wait()
    except KeyboardInterrupt:
        return 0
    except RuntimeError as e:                                       # exited or timed out during start-up
        print(e, file=sys.stderr)
        return 1
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
