"""What training runs on besides the model and the loss: micro-batches and their balance across ranks
(`micro_batches`, `rank_balance`), exact global metrics (`metrics`), throughput and MFU (`perf`), checkpoint
files (`checkpoint`), strategies (`strategies`), and the private internals of the libraries below (`compat`)."""
