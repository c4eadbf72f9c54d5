#!/bin/sh
# First start: create the cluster with password authentication for the network (the password is
# read from the file named by POSTGRES_PASSWORD_FILE, or POSTGRES_PASSWORD), and the database.
set -eu
: "${POSTGRES_USER:=spade}" "${POSTGRES_DB:=spade}"
if [ ! -s "$PGDATA/PG_VERSION" ]; then
  pwfile=$(mktemp)
  if [ -n "${POSTGRES_PASSWORD_FILE:-}" ]; then cat "$POSTGRES_PASSWORD_FILE" >"$pwfile"; else printf %s "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD or POSTGRES_PASSWORD_FILE}" >"$pwfile"; fi
  initdb -D "$PGDATA" -U "$POSTGRES_USER" --pwfile="$pwfile" --encoding=UTF8 --locale=C.UTF-8 --auth-local=trust --auth-host=scram-sha-256 >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
  echo "CREATE DATABASE $POSTGRES_DB" | postgres --single -D "$PGDATA" postgres >/dev/null
fi
exec postgres -D "$PGDATA" -c listen_addresses='*' -c unix_socket_directories=/var/run/postgresql
