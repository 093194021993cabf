"""`llmrt quantize MODEL --out DIR`: a GPTQ-format 4-bit checkpoint of a float one, calibrated on activations
(GPTQ: error compensation by the inverse input Hessian, layer by layer) or rounded to nearest (`--method rtn`).
`llmrt serve DIR` serves the result as int4; `llmrt bench quality DIR --reference MODEL` scores it."""
from __future__ import annotations

import argparse
import json

from llmrt.model.quantization.gptq_calibrate import CalibrationOptions, quantize_checkpoint, report_dict
from llmrt.model.quantization.gptq_solver import QuantSpec


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `llmrt quantize`."""
    p.add_argument("model", help="a float HF safetensors checkpoint directory")
    p.add_argument("--out", required=True, help="directory to write the quantized checkpoint to")
    p.add_argument("--method", default="gptq", choices=["gptq", "rtn"],
                   help="gptq: calibrated with error compensation (default); rtn: round to nearest, no data")
    p.add_argument("--bits", type=int, default=4, choices=[4], help="weight bits (4 only: served by int4)")
    p.add_argument("--group-size", type=int, default=32, choices=[32, 64, 128], help="inputs per scale (default 32)")
    sym = p.add_mutually_exclusive_group()
    sym.add_argument("--sym", dest="sym", action="store_true", default=False,
                     help="symmetric groups (zero point fixed at 8)")
    sym.add_argument("--asym", dest="sym", action="store_false",
                     help="asymmetric groups, an integer zero point each (default: lower error)")
    p.add_argument("--calibration", default="builtin",
                   help="a text file to calibrate on, or 'builtin': sequences sampled from the float model itself "
                        "(temperature 1 from BOS; never the quality bench's text). Default: builtin")
    p.add_argument("--samples", type=int, default=128, help="calibration sequences (default 128)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per calibration sequence (default 256)")
    p.add_argument("--damp", type=float, default=0.01,
                   help="damping added to the Hessian's diagonal, as a fraction of its mean (default 0.01)")
    p.add_argument("--no-clip-search", dest="clip_search", action="store_false",
                   help="use each group's full range (default: the range shrink with the least weight error)")
    p.add_argument("--device", default="cpu", help="where to run the model and the solver: cpu (default), cuda")
    p.add_argument("--seed", type=int, default=0, help="seed of the builtin samples and of window shuffling")
    p.add_argument("--report", default=None, help="write per-layer output errors (vs round-to-nearest) as JSON")


def run(args: argparse.Namespace) -> int:
    """Quantize, then print where the checkpoint went and the error against round-to-nearest."""
    from llmrt.errors import InvalidRequestError

    if args.samples < 1 or args.seq_len < 2 or not 0 < args.damp < 1:
        raise InvalidRequestError("--samples must be >= 1, --seq-len >= 2 and --damp in (0, 1)")
    opts = CalibrationOptions(method=args.method, spec=QuantSpec(args.group_size, args.sym, args.clip_search),
                              calibration=args.calibration, samples=args.samples, seq_len=args.seq_len,
                              damp=args.damp, seed=args.seed, device=args.device)
    report = quantize_checkpoint(args.model, args.out, opts)
    ratio = sum(r.error for r in report.layers) / max(sum(r.rtn_error for r in report.layers), 1e-30)
    print(f"wrote {report.out_dir}: {len(report.layers)} layers, {args.method} int4 g{args.group_size} "
          f"{'sym' if args.sym else 'asym'}, {report.calibration_tokens} calibration tokens, {report.seconds:.1f} s")
    print(f"summed layer output error on the calibration inputs: {ratio:.3f}x round-to-nearest's")
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report_dict(report), f, indent=2)
    return 0
