"""Hard limits from the seeds and the kernel, in one place (each enforced and tested at its edge).

Sizes are bytes unless named otherwise.
"""

REVISION_MIN = 1
REVISION_MAX = 2_147_483_647            # ADR-0376 §1: revision 1..2^31-1

DIGEST_HEX_LEN = 64                     # lowercase hex SHA-256

# Kernel MAX_ARG_STRLEN: one argv string or one "KEY=VALUE" env entry, NUL included.
MAX_ARG_STRLEN = 131_072
MAX_ARGV_COUNT = 256                    # execution revision argv entries
MAX_ARGV_TOTAL = 131_072                # all argv strings together, NULs included
MAX_SCRIPT_BYTES = 65_536               # inline /bin/sh or /bin/bash script
MAX_ENV_ENTRIES = 256                   # context recipe public values + SecretRefs
MAX_ENV_TOTAL = 1_048_576               # the whole frozen environment, NULs included
MAX_PATH_BYTES = 4_096                  # cwd and other paths
MAX_START_ERROR = 512                   # characters of a start-failure reason (launcher START_ERROR_LIMIT)
# A shim reports its task's exec within its start-up time (milliseconds; seconds on a loaded
# router). Past this bound (monotonic clock: a clock step neither ends a start nor extends it)
# the start fails with its reason: a shim that did not report is killed, a fork server that
# forked none is retired, a compile still running is killed (adapters.processes.ForkServer.advance).
SHIM_START_BOUND_US = 30_000_000

MAX_TASK_NAME = 64
MAX_LABELS = 32
MAX_LABEL_BYTES = 128
MAX_SECRET_NAME = 64
MAX_SECRET_VALUE = 65_536
MAX_TIMEOUT_S = 7 * 24 * 3600
MAX_CATCH_UP_WITHIN_S = 366 * 24 * 3600  # catch_up_within_s: a year and a day
MAX_RETRY_ATTEMPTS = 10
MAX_RETRY_BACKOFF_S = 24 * 3600
MAX_TASKS_PER_FILE = 1_000
MAX_TASK_FILE_BYTES = 4 * 1_048_576

MIN_RUN_MEMORY = 4 * 1_048_576         # a Task's memory_max floor: below it not even the shim fits
MEMORY_UNITS = {"K": 1024, "M": 1_048_576, "G": 1_073_741_824}   # binary, as systemd's MemoryMax=

SHELL_ALLOWLIST = ("/bin/sh", "/bin/bash")
RESERVED_ENV_PREFIX = "QL3_"
# Directory modes: the most ``doctor`` accepts, and what the packages set (systemd
# StateDirectoryMode= and tmpfiles, the OpenWrt init script; tests/test_packaging.py reads them
# against these). The qlagent group may read the state dir; only the owner writes. Log
# artifacts and run dirs stay owner-only (ADR-0071 §4 step 7).
STATE_DIR_MODE = 0o750
PRIVATE_DIR_MODE = 0o700

# Free bytes the state directory's file system must keep for a Run to start: the WAL frames of
# the few transactions one Run writes (claim, running, finish; each a handful of 4 KiB pages).
STATE_MIN_FREE_BYTES = 65_536
# Inodes one Run takes on the artifact file system: its log (and shard directory), its run
# directory with the FIFO, the spec, receipt and truncation fact, and the atomic writes' temps.
RUN_INODES = 16
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
