/* The store server across fork(2): for a launcher that binds the server in
 * its own process (so the address is known and errors are its own), then
 * forks a child that serves (ddp_store_server_run) while the parent goes on
 * without it. Not a public header. */
#ifndef DDP_STORE_SERVER_FORK_H
#define DDP_STORE_SERVER_FORK_H

#include "ddp/store.h"

/* Drops this process's copy of a server created (ddp_store_server_create) and
 * then forked, without touching the other process's: closes this process's
 * fds (listening socket, epoll fd, eventfd, spare fd, clients) and frees the
 * memory. It never signals: ddp_store_server_stop / _shutdown here would
 * write the eventfd the child's loop shares and stop the child's server, and
 * epoll_ctl would edit the child's epoll set. Only for a server that is not
 * running in this process (no run, no thread: refused with an error log).
 * Accepts NULL. */
void ddp__store_server_forget(ddp_store_server *server);

#endif /* DDP_STORE_SERVER_FORK_H */
