"""``postcard generate | evaluate | export RUN_DIR``: use a finished run's final global model.

    postcard generate outputs/<run> "To be, or not to be" --max-new-tokens 40
    postcard evaluate outputs/<run>             # every client's held-out split, as in the run
    postcard export outputs/<run> merged/       # LoRA / full / FLITE: a standalone checkpoint

The model is rebuilt from the run folder alone (``fedapps.final.load_run``): its
``config.yaml`` and final state. ``evaluate`` prints each client's metric, the aggregate
and the run's own final metric beside it (they agree: the same model, splits and
settings). ``export`` merges LoRA adapters and FLITE's latents into the weights (a Hugging
Face checkpoint for a causal LM, ``model.safetensors`` for a vision model); FedNL and
SmartFed are refused with the reason. Exit status 2 on a bad folder or request.
"""

from __future__ import annotations

import argparse
import json
import sys

from fedapps.method import FinalStateError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="postcard", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="continue a prompt with the run's final model (causal LMs)")
    g.add_argument("run_dir")
    g.add_argument("prompt")
    g.add_argument("--max-new-tokens", type=int, default=40)
    g.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--seed", type=int, default=0, help="the sampling seed")
    e = sub.add_parser("evaluate", help="the run's held-out evaluation of its final model")
    e.add_argument("run_dir")
    e.add_argument("--json", action="store_true", help="print the result as JSON")
    x = sub.add_parser("export", help="the final model as a standalone checkpoint (LoRA, full, FLITE)")
    x.add_argument("run_dir")
    x.add_argument("target", help="a new folder")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    from fedapps.final import load_run

    try:
        final = load_run(args.run_dir)
        if args.command == "generate":
            if args.max_new_tokens < 1:
                raise FinalStateError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
            print(args.prompt + final.generate(args.prompt, args.max_new_tokens, greedy=not args.sample,
                                               seed=args.seed))
        elif args.command == "evaluate":
            metric = str(final.cfg.task.metric)

            def progress(pid, n, metrics):
                if not args.json:
                    print(f"client {pid + 1}/{n}: {metric} {metrics[metric]:,.4f} on {metrics['num-examples']} examples",
                          flush=True)

            result = final.evaluate(progress)
            result["run_final_metric"] = final.summary.get("final_metric")
            if args.json:
                print(json.dumps(result, indent=1, default=float))
            else:
                print(f"aggregate {metric}: {result['aggregate'][metric]:,.4f} (the run recorded "
                      f"{result['run_final_metric']:,.4f})")
        else:
            print(f"exported to {final.export(args.target)}")
    except (FinalStateError, ValueError) as err:
        print(f"postcard {args.command}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
