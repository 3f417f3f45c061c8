"""What a head-pattern config must hold against dense before it serves, measured as served
(``served_policy.py``): one place for the defaults and the flags' words, so that the server's
self-calibration (its ladder, its gate, its drift check: ``mminfer serve``) and ``mminfer
calibrate`` (its verdict) judge by the same numbers under the same names. Light (no torch):
both command lines read it for ``--help``."""

from __future__ import annotations

MIN_AGREEMENT = 0.98     # share of greedy answers equal to dense's, at least
MAX_KL = 0.02            # mean last-token KL(dense || sparse) in nats, at most

MIN_AGREEMENT_FLAG = "--calibration-min-agreement"
MAX_KL_FLAG = "--calibration-max-kl"


def add_threshold_arguments(group, *, min_agreement: float = MIN_AGREEMENT,
                            max_kl: float = MAX_KL, what: str) -> None:
    """The two flags, on an argparse parser or group; ``what`` says where they apply."""
    group.add_argument(MIN_AGREEMENT_FLAG, type=float, default=min_agreement,
                       help="a config serves only if this share of its greedy answers equals "
                            f"dense's ({what})")
    group.add_argument(MAX_KL_FLAG, type=float, default=max_kl,
                       help="... and its mean last-token KL(dense || sparse) is at most this")


def check_thresholds(min_agreement: float, max_kl: float) -> str | None:
    """Why the pair is not usable, or None."""
    if not 0 <= min_agreement <= 1 or not max_kl >= 0:
        return (f"{MIN_AGREEMENT_FLAG} must be in [0, 1] and {MAX_KL_FLAG} >= 0 (got "
                f"{min_agreement:g} and {max_kl:g})")
    return None
