"""What a head-pattern config must hold against dense before it serves, measured as served
(``served_policy.py``): one place for the defaults and the flags' words, so that the server's
self-calibration (its ladder, its gate, its drift check: ``mminfer serve``) and ``mminfer
calibrate`` (its verdict) judge by the same numbers under the same names. Light (no torch):
both command lines read it for ``--help``."""

from __future__ import annotations

MIN_AGREEMENT = 0.98     # share of greedy answers equal to dense's, at least
MAX_KL = 0.02            # mean last-token KL(dense || sparse) in nats, at most
# a config that holds only at a higher mean density would serve no faster than dense
# (served_policy.SearchSettings says how the number was chosen)
MAX_SERVED_DENSITY = 0.85

MIN_AGREEMENT_FLAG = "--calibration-min-agreement"
MAX_KL_FLAG = "--calibration-max-kl"
MAX_DENSITY_FLAG = "--calibration-max-density"


def add_threshold_arguments(group, *, min_agreement: float = MIN_AGREEMENT,
                            max_kl: float = MAX_KL,
                            max_density: float = MAX_SERVED_DENSITY, what: str) -> None:
    """The three flags, on an argparse parser or group; ``what`` says where they apply."""
    group.add_argument(MIN_AGREEMENT_FLAG, type=float, default=min_agreement,
                       help="a config serves only if this share of its greedy answers equals "
                            f"dense's ({what})")
    group.add_argument(MAX_KL_FLAG, type=float, default=max_kl,
                       help="... and its mean last-token KL(dense || sparse) is at most this")
    group.add_argument(MAX_DENSITY_FLAG, type=float, default=max_density,
                       help="... and its mean density is at most this (a denser config would "
                            "serve no faster than dense; 1: any density)")


def check_thresholds(min_agreement: float, max_kl: float,
                     max_density: float = MAX_SERVED_DENSITY) -> str | None:
    """Why the three are not usable, or None."""
    if not 0 <= min_agreement <= 1 or not max_kl >= 0 or not 0 < max_density <= 1:
        return (f"{MIN_AGREEMENT_FLAG} must be in [0, 1], {MAX_KL_FLAG} >= 0 and "
                f"{MAX_DENSITY_FLAG} in (0, 1] (got {min_agreement:g}, {max_kl:g} and "
                f"{max_density:g})")
    return None
