"""The cluster: a job's [cluster] section as a Dask client (LocalCluster, one worker per GPU, an
existing scheduler, or SLURM/PBS/LSF/SGE through dask-jobqueue).

Reads: the job's [cluster] settings. Writes: nothing; it starts and stops workers.
"""
