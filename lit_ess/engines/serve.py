"""Start a vLLM server that `lit_ess.engines.VLLMServerConfig(urls=[...])` can use, on any machine,
with exactly the flags of the server lit-ess launches itself (`vllm_server.server_command`); prints
its URL when it answers /health and runs until Ctrl-C or SIGTERM, which stop it.

    python -m lit_ess.engines.serve --model runs/demo/sft --port 8000 [--host 10.0.0.5] [extra vLLM flags]
"""
from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from .vllm_server import LaunchedServer, VLLMServerConfig, server_command, server_env


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lit_ess.engines.serve",
                                description="Start a vLLM server for lit-ess's VLLMServerConfig(urls=[...]); "
                                            "flags it does not know pass through to vLLM.")
    p.add_argument("--model", required=True, help="the model folder the trainer starts from (model.model_path)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1",
                   help="interface to listen on; the weight routes are unauthenticated: use a private one")
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
        p.error(f"--model {args.model}: no config.json there (a Hugging Face model folder, e.g. runs/demo/sft)")
    try:
        c = VLLMServerConfig(dtype=args.dtype, max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib,
                             gpu_memory_utilization=args.gpu_memory_utilization, port=args.port, server_args=extra,
                             max_lora_rank=args.max_lora_rank)
    except ValueError as e:
        p.error(str(e))
    url = f"http://{args.host}:{args.port}"
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))           # SIGTERM stops the server as Ctrl-C does
    server = LaunchedServer(server_command(args.model, c, args.host, args.port), server_env(c), args.log_file, url)
    print(f"starting vLLM for {args.model} (log: {server.log_file})", flush=True)
    try:
        seconds = server.wait_ready(args.startup_timeout)
        print(f"ready in {seconds:.0f} s: {url}   (engine: {{class_path: lit_ess.engines.VLLMServerConfig, "
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
