"""The documented path of the options records (`from tiering.options import TierOptions,
option`): the module is `tiering.tier.options`, beside the object format whose codecs and
checksums `TierOptions` names; everything it exports is importable from here too."""

from tiering.tier.options import KINDS, REQUIRED, Field, TierOptions, fields_of, option, read_fields

__all__ = ["KINDS", "REQUIRED", "Field", "TierOptions", "fields_of", "option", "read_fields"]
