#!/bin/sh
# The checkpoint plane's private CA and the two certificates it signs, made once into DIR (docker-compose's
# checkpoint-tls service; needs openssl 3):
#   ca.crt                      the CA every side trusts
#   receiver.crt, receiver.key  rollout servers' (DNS name SERVER_NAME, which the trainer checks)
#   trainer.crt, trainer.key    the trainer's, which the receivers require
# The CA's key is deleted once both are signed, so nothing can sign another. A DIR that has ca.crt is kept.
# Usage: checkpoint-tls.sh DIR SERVER_NAME
set -eu
dir=$1
server_name=$2
if [ -f "$dir/ca.crt" ]; then
  echo "checkpoint-tls: $dir/ca.crt exists; keeping the certificates there"
  exit 0
fi
umask 077
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
key="-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -noenc"
# shellcheck disable=SC2086
openssl req -x509 $key -keyout "$work/ca.key" -out "$work/ca.crt" -days 3650 -subj "/CN=rollwave checkpoint CA"
for leaf in receiver trainer; do
  name=$server_name
  [ "$leaf" = trainer ] && name=rollwave-trainer
  # shellcheck disable=SC2086
  openssl req $key -keyout "$work/$leaf.key" -out "$work/$leaf.csr" -subj "/CN=$name" \
    -addext "subjectAltName=DNS:$name"
  openssl x509 -req -in "$work/$leaf.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" -CAcreateserial \
    -out "$work/$leaf.crt" -days 3650 -copy_extensions copy
  mv "$work/$leaf.crt" "$work/$leaf.key" "$dir/"
done
mv "$work/ca.crt" "$dir/ca.crt"  # last: its presence means the set is complete
echo "checkpoint-tls: made a CA and the receiver's ($server_name) and trainer's certificates in $dir"
