"""The lab tools users run offline, apart from the serving pass: signature training, layer-role
calibration, quality evaluation (`harness`: token by token through the compiled model; `agreement`:
many tokens in one masked forward pass; the bench scripts are their command lines), real text and
the offline model, the demo and the command line.

The product never imports this package (`import sparse_fx` loads none of it); `sparse_fx.calibrate`
and `sparse_fx.train_signatures` reach it lazily.
"""
