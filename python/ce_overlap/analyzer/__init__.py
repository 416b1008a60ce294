"""The offline analyzer behind `ce-overlap analyze` (ce_overlap/cli.py): the training step per mode from a captured
step (step_model.py, no torch) and the reports that say what to do (report.py). The capture and the C++ analysis it
reads are ce_overlap.capture / ce_overlap.analyze (ir.py). docs/analysis.md."""
