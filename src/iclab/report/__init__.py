"""A browsable static report of the result store (``iclab report``)."""

from iclab.report.site import build_site, collect_runs, write_curves_csv

__all__ = ["build_site", "collect_runs", "write_curves_csv"]
