"""kvtier's data plane: the shared CPU primary region, the GPU<->CPU and CPU<->CPU copy engines,
and the secondary tier backends (file, redis, s3, memory). Everything here moves bytes; the
decisions are taken in `tiering/`."""
