//! The allocator: measured costs, exposure-conditioned risk, budgets and the plan solver.
