"""The MaskSpec DSL: what users declare, and the front end that reads their rules."""

from compilemask.dsl.spec import MaskSpec, Region

__all__ = ["MaskSpec", "Region"]
