"""The memory plan: the ledger of each replica, the budget, and the planner that fits one to the other."""
