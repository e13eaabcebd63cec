"""The lab tools users run offline, apart from the serving pass: signature training, layer-role
calibration, the quality harness (the one evaluator that the bench scripts and the CLI call),
real text and the offline model, the demo and the command line.

The product never imports this package (`import sparse_fx` loads none of it); `sparse_fx.calibrate`
and `sparse_fx.train_signatures` reach it lazily.
"""
