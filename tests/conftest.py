import iclab  # noqa: F401  (turns on float64 before any test builds arrays)
