"""`eyas verify STORE`: checksums, counts and consistency, then recompute samples with the target.

Exit status 0 when the store is valid, 1 on any mismatch (each printed on its own line).
"""

from __future__ import annotations

from eyas.commands import non_negative_int


def add_arguments(parser) -> None:
    parser.add_argument("store", metavar="STORE", help="store directory written by `eyas capture`")
    parser.add_argument("--target", help="target to recompute with (default: the one the manifest names)")
    parser.add_argument("--samples", type=non_negative_int, default=4, help="samples to recompute (0 = files only; default 4)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="which random samples to recompute")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")


def main(args) -> int:
    from eyas.stages import verify

    report = verify.run(args.store, target_model=args.target, device=args.device, num_samples=args.samples,
                        seed=args.seed)
    print(f"{args.store}: {report['num_shards']} shards, {report['num_samples']:,} samples, "
          f"{report['num_tokens']:,} tokens, {report['dtype']}, {'complete' if report['complete'] else 'INCOMPLETE'}")
    if report["nonfinite_ids"]:
        ids = report["nonfinite_ids"]
        print(f"{len(ids)} sample(s) hold NaN or inf in their captured states, training skips them: "
              f"{', '.join(ids[:5])}{', ...' if len(ids) > 5 else ''}")
    if report["layers"]:
        worst: dict[str, tuple[float, float, float]] = {}
        for row in report["layers"]:
            a, r, t = worst.get(row["layer"], (0.0, 0.0, 0.0))
            # max() keeps a NaN only when it comes first: a NaN row is named among the problems anyway
            worst[row["layer"]] = (max(a, row["max_abs"]), max(r, row["rel"]), max(t, row["per_token"]))
        samples = len({row["sample"] for row in report["layers"]})
        print(f"recomputed {samples} sample(s); worst error per layer (per token: the median over a sample's tokens "
              f"of error norm / state norm):")
        print(f"  {'layer':<10} {'max abs':>10} {'relative':>10} {'per token':>10}")
        for layer, (a, r, t) in worst.items():
            print(f"  {layer:<10} {a:>10.3e} {r:>10.3e} {t:>10.3e}")
    for line in report["problems"]:
        print(f"MISMATCH: {line}")
    print("OK" if not report["problems"] else f"FAILED: {len(report['problems'])} problem(s)")
    return 0 if not report["problems"] else 1
