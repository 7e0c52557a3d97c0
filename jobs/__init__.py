"""Entrypoints for `ray job submit`: each is `python -m pipeline <command>` with the job's arguments.

    ray job submit --address http://HEAD:8265 --working-dir . --runtime-env jobs/runtime_env.yaml \
        -- python -m jobs.train --config configs/demo.toml --data.path s3://bucket/demo --run.output s3://bucket/runs

They hold no logic: inside a Ray job RAY_ADDRESS is set, so pipeline.cluster.runtime.init_ray joins the
cluster the job runs on, and errors are reported exactly as the CLI reports them (exit status 2 and
one paragraph for bad input).
"""
