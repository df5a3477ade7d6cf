/* Reading flight recorder dumps (the JSON that src/comm/flight_dump.c
 * writes; docs/comm.md, "Flight recorder") back into the model of
 * comm/flight.h, for ddprun's verdict and `ddp-debug flight`. With io's
 * JSON parser: every field checked for its kind and range before use. Not
 * installed. */
#ifndef DDP_LAUNCH_FLIGHT_READ_H
#define DDP_LAUNCH_FLIGHT_READ_H

#include <stddef.h>

#include "comm/flight/flight.h"

/* Parses text[0..len) into *dump (free with ddp__flight_dump_free). `what`
 * names the source in errors ("/tmp/ddp-flight-rank2.json", "rank 2's dump
 * in the store"). DDP_ERR_FORMAT naming the field (and the offset for JSON
 * errors) when it is not a dump of this format and version; *dump is then
 * empty. */
ddp_status ddp__flight_parse(const char *text, size_t len, const char *what, ddp__flight_dump *dump);

/* Reads and parses the file at path (at most 1 GiB). */
ddp_status ddp__flight_read_file(const char *path, ddp__flight_dump *dump);

#endif /* DDP_LAUNCH_FLIGHT_READ_H */
