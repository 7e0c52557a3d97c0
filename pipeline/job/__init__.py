"""The built-in `train` job, one client of the public API (`pipeline.prepare`, `pipeline.rank_data`):
its model (model.py), evaluation (evaluate.py), the loop in each worker (loop.py) and the driver
(driver.py). Its modules import nothing from the package a user could not, besides each other."""
