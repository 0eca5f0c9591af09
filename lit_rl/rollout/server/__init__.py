"""The trainer's side of vLLM servers: the HTTP client and the command that starts a server (`client`), the run's
servers with health checks and failover (`pool`), and the weight transports: files or uploads to a receiver
beside each server (`weight_receiver`), or a broadcast (`collective_transfer`). Imports no vLLM."""
