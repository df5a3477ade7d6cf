# Sourced by the tests that run ddp under mpirun (tests/comm/test_mpi.sh,
# tests/train/test_ddp_train_mpi.sh): the environment their ranks need.
# - Open MPI's own allocations that it keeps until exit are suppressed for
#   LeakSanitizer by library (tests/comm/mpi.supp; docs/comm.md, "MPI
#   backend"); ddp's code is not. For the suppressions to see MPI's frames,
#   its plugins stay loaded (no dlclose in MPI_Finalize) and stacks are
#   unwound through its code built without frame pointers.
# - A loaded machine with more ranks than cores: ranks yield while they
#   poll; no cross-memory attach (containers often forbid ptrace).
mpi_env_supp=$(cd "$(dirname "${BASH_SOURCE[0]}")/../comm" && pwd)/mpi.supp
export LSAN_OPTIONS="suppressions=$mpi_env_supp:print_suppressions=0${LSAN_OPTIONS:+:$LSAN_OPTIONS}"
export ASAN_OPTIONS="fast_unwind_on_malloc=0${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export OMPI_MCA_mca_base_component_disable_dlclose=1
# ThreadSanitizer: Open MPI's uninstrumented code (tests/comm/mpi-tsan.supp).
export TSAN_OPTIONS="suppressions=${mpi_env_supp%/*}/mpi-tsan.supp${TSAN_OPTIONS:+:$TSAN_OPTIONS}"
export OMPI_MCA_mpi_yield_when_idle=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
