"""Offline calibration of SCD codec artifacts: moments and linear fits, learned predictor
training, the loss (teacher-forced KL), schedule search, recompute-span profiling and the
`python -m calibration` CLI. Sits above the serving runtime (`shared`), which never imports it;
what it writes is an artifact file that `shared.scd.artifact` reads.
"""
