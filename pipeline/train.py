"""The built-in training job (`python -m pipeline train`, `python -m jobs.train`): one client of the
public API, in pipeline/job/ (model.py, evaluate.py, loop.py, driver.py). Its names stay reachable
here: `train.run(cfg)` runs it.
"""

from .job.driver import (Background, PlanBox, RESUME_KEYS, check_cluster_fits, check_elastic, check_resume,  # noqa: F401
                         first_step_line, fit_beside, plan_run, prepare_run, run, run_name, workers_beside_fit)
from .job.evaluate import (AUC_BINS, binned_auc, evaluate, metric_keys, target_figures, target_keys,  # noqa: F401
                           target_metrics)
from .job.loop import CHECKPOINT_FILE, FIT_FILE, PREPROCESSOR_FILE, QUARANTINE_FILE, train_loop_per_worker  # noqa: F401
from .job.model import (SPARSE_ROWS, Optimizers, TabularMLP, batch_loss, build_model, head_widths,  # noqa: F401
                        per_row_loss, sparse_embeddings)
