"""Row rules: one module per optimizer (its slots, hyper-parameters and update)."""
