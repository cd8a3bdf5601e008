"""The `_batchvl/` folder inside `output.dir`: batchvl's own files beside the results, named here once.
Everything under it is bookkeeping; nothing else in `output.dir` is batchvl's but the results themselves
and the dataset card, `README.md`."""

OWN_FILES = "_batchvl"
MARKERS = f"{OWN_FILES}/done"  # a shard's completion marker: <shard>.json, written last in its commit
# <shard>.json: the stamp of the input file a committed shard was made from (beside its marker, which
# earlier versions read and would refuse with a field they do not know)
INPUT_STAMPS = f"{OWN_FILES}/inputs"
CLAIMS = f"{OWN_FILES}/claims"  # <shard>.lock: which run is writing a shard now
STATS = f"{OWN_FILES}/stats"  # run-*.json: one per run, what it did
FOLDER_SHARDS = f"{OWN_FILES}/folder_shards"  # the recorded shards of `folder` input
SLURM = f"{OWN_FILES}/slurm"  # the sbatch script and the array it was submitted as
LOGS = f"{OWN_FILES}/logs"  # task-I.log of Slurm array tasks, server-I.log of servers batchvl launched
STAGED_INPUT = f"{OWN_FILES}/input"  # the notebook API's copy of an in-memory dataset
CARD = f"{OWN_FILES}/card"  # <digest of the shard>.json: what the dataset card counts of each shard
CARD_FILE = "README.md"  # the dataset card, at the top of output.dir
