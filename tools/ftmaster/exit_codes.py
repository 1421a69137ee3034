"""Exit statuses by which the trainer tells the supervisor what went wrong.

The numbers follow ``sysexits.h`` where one fits. Each has a meaning the supervisor acts on,
so that a full disk or a broken checkpoint is never retried as if a GPU had failed.
"""

USAGE = 2
"""Bad arguments, or a checkpoint that cannot continue under them: the user must fix them."""
NONFINITE = 65
"""EX_DATAERR: a NaN or Inf loss or gradient norm; that iteration updated and saved nothing."""
NO_CHECKPOINT = 66
"""EX_NOINPUT: the load folder holds checkpoints and none of them can be loaded."""
DATA = 79
"""Outside sysexits.h (65, EX_DATAERR, is the NaN's): the training data cannot be read (a
corrupt corpus, one made with another tokenizer); no GPU is at fault."""
PEER_READ = 69
"""EX_UNAVAILABLE: a peer failed or stalled while the shards this node lacks of a node-local
memory checkpoint were read from it; the next round agrees anew on what the nodes hold."""
STORAGE = 74
"""EX_IOERR: the final (or exit) checkpoint could not be written."""
REQUEUE = 75
"""EX_TEMPFAIL: the job's rendezvous store is gone; requeue the job."""
GAVE_UP = 1
"""ftmaster gave up on something a requeue may cure (the restart budget spent, too few GPUs or
nodes for any layout): fresh nodes may do."""
DO_NOT_REQUEUE = 93
"""ftmaster gave up on something a requeue cannot cure (bad arguments, a storage error, no
loadable checkpoint, a crash loop): NVIDIA's resiliency launcher's "do not requeue" status."""

TRAINER_CAUSES = {NONFINITE: "nonfinite", NO_CHECKPOINT: "no_checkpoint", STORAGE: "storage",
                  USAGE: "usage", DATA: "data", PEER_READ: "peer_read"}
"""The failure cause the supervisor reports for each trainer exit status."""
