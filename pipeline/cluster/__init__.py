"""Stage 3, cluster: where the work runs.

tasks.py holds the units of work (fit a group of row groups, transform a rank's pieces), the same
functions wherever they run; ray_side.py runs them as Ray tasks and Ray Data (the distributed fit, the
count shuffle, each rank's share on its own node); local_side.py on threads in this process (torchrun,
notebooks, a one-node fit); runtime.py starts or joins Ray and sets its workers up.
"""
