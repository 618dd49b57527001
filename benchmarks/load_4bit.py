"""Peak host memory while a 16B-shaped Hugging Face folder loads into a 4-bit LoRA base (`load_pretrained(quantize4=)`,
what `anyseek train --init DIR --train.base_bits=4` does), against the issue's bound: 1.2x the 4-bit model plus one
tensor.

    python benchmarks/load_4bit.py [--layers 27] [--device cuda] [--folder /tmp/anyseek-16B-random-27] [--stream]

Writes a random-weight bf16 folder of the `16B` flavor with --layers decoder layers first where --folder has none
(the same folder benchmarks/finetune_4bit.py --peer writes), then loads it in a fresh process, sampling the process's
anonymous resident memory (RssAnon: what the load allocated; the safetensors files are memory-mapped, and their pages
count as RssFile, page cache the kernel may drop) every 10 ms. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

GiB = 1 << 30


def child(folder: str, device: str) -> None:
    import math
    import threading
    import time

    import torch

    from anyseek import hf
    from anyseek.hf.safetensors_io import scan_folder
    from anyseek.transforms import lora as lora_lib

    def rss() -> tuple[int, int]:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
        return tuple(int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile"))

    peak, done = [0, 0], threading.Event()

    def sample():
        while not done.is_set():
            a, f = rss()
            peak[0], peak[1] = max(peak[0], a), max(peak[1], f)
            time.sleep(0.01)

    before = rss()[0]
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    spec = lora_lib.LoRASpec(rank=16, base_bits=4)
    t0 = time.perf_counter()
    model = hf.load_pretrained(folder, dtype=torch.bfloat16, device=device,
                               quantize4=lambda m: lora_lib.quantized_names(m, spec))  # fmt: skip
    seconds = time.perf_counter() - t0
    done.set()
    thread.join()
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    width = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "F8_E5M2": 1}
    largest = max(math.prod(i.shape) * width.get(i.dtype, 4) for i in scan_folder(Path(folder)).values())
    print(json.dumps({"device": device, "model_bytes": size, "largest_tensor_bytes": largest, "seconds": seconds,
                      "anon_before": before, "anon_peak": peak[0], "file_peak": peak[1]}))


def write_random_folder(mc, folder: Path) -> None:
    """A Hugging Face folder of `mc`'s shape with random bf16 weights (0.02 x normal; vectors ones), made one
    shard at a time: the model exists only on the meta device, so the host never holds more than a shard."""
    import torch

    from anyseek.hf import pretrained
    from anyseek.hf.safetensors_io import write_shards
    from anyseek.model.transformer import DeepSeekV3

    model = DeepSeekV3(mc, device="meta")
    gen = torch.Generator().manual_seed(0)

    def random_like(make):
        def made():
            t = make()  # (a meta tensor: its shape and dtype)
            if t.dim() < 2 or not t.is_floating_point():
                return torch.ones(t.shape, dtype=t.dtype) if t.is_floating_point() else torch.zeros(t.shape, dtype=t.dtype)
            return (torch.randn(t.shape, generator=gen) * 0.02).to(t.dtype)
        return made

    entries = [(name, size, random_like(make)) for name, size, make in
               pretrained._save_entries(model, mc.num_hidden_layers, mc.num_nextn_predict_layers, torch.bfloat16)]
    folder.mkdir(parents=True, exist_ok=True)
    write_shards(entries, folder, "2GB")
    pretrained._write_configs(model, mc, folder, torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--flavor", default="16B", help="the shape (tiny: a dry run of the script on a CPU)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--folder", default=None)
    ap.add_argument("--stream", action="store_true", help="write the random folder tensor by tensor (a host with "
                    "less memory than the bf16 model: the whole 16B is 31 GB)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    folder = args.folder or f"/tmp/anyseek-{args.flavor}-random-{args.layers}"
    if args.child:
        return child(folder, args.device)
    if not (Path(folder) / "config.json").is_file():
        import torch

        from anyseek import hf
        from anyseek.model.config import ModelConfig
        from anyseek.model.transformer import DeepSeekV3

        torch.manual_seed(0)
        wide = {"moe_intermediate_size": 64, "kv_lora_rank": 64} if args.flavor == "tiny" else {}  # (64-wide groups)
        mc = ModelConfig.from_name(args.flavor, num_hidden_layers=args.layers, num_nextn_predict_layers=0, **wide)
        if args.stream:
            write_random_folder(mc, Path(folder))
        else:
            hf.save_pretrained(DeepSeekV3(mc, dtype=torch.bfloat16), folder, dtype=torch.bfloat16)
    out = subprocess.run([sys.executable, __file__, "--child", "--folder", folder, "--device", args.device,
                          "--layers", str(args.layers)], capture_output=True, text=True, check=True)  # fmt: skip
    r = json.loads(out.stdout.strip().splitlines()[-1])
    grown = r["anon_peak"] - r["anon_before"]
    bound = 1.2 * r["model_bytes"] + r["largest_tensor_bytes"]
    on_host = r["device"] == "cpu"
    print(f"{args.flavor} shape, {args.layers} layers, 4-bit base loaded to {r['device']} in {r['seconds']:.0f} s")
    print("| 4-bit model GiB | largest tensor GiB | host anon. memory grown GiB | peak file pages GiB | bound GiB |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| {r['model_bytes'] / GiB:.2f} | {r['largest_tensor_bytes'] / GiB:.2f} | {grown / GiB:.2f} | "
          f"{r['file_peak'] / GiB:.2f} | {bound / GiB:.2f}{'' if on_host else ' (the model is on the GPU)'} |")


if __name__ == "__main__":
    main()
