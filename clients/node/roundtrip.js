// A Squall client in a second language, built from the public protos alone: it loads only
// squall/v1/{common,broker,gateway}.proto from the directory given (the test copies just
// those there), uses @grpc/grpc-js with default channel options, and publishes and reads
// back through a gateway. Run by tests/integration/test_node_client.py; prints one JSON
// line with what it saw, or exits non-zero with the gRPC error.
//
//   node roundtrip.js --gateway HOST:PORT --protos DIR --topic NAME [--ask-bytes N]
//
// --ask-bytes: a reader that asks for more bytes per response (SubscribeRequest.
// max_batch_bytes) than its channel accepts; it fails with RESOURCE_EXHAUSTED and goes
// away mid-stream (the gateway logs that at INFO).
"use strict";

const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");
const path = require("path");

function args() {
  const out = {};
  const argv = process.argv.slice(2);
  for (let i = 0; i < argv.length; i += 2) out[argv[i].replace(/^--/, "")] = argv[i + 1];
  for (const need of ["gateway", "protos", "topic"]) {
    if (!out[need]) throw new Error(`missing --${need}`);
  }
  return out;
}

function load(dir) {
  const files = ["broker.proto", "gateway.proto"].map((f) => path.join("squall", "v1", f));
  // 64-bit fields (offsets, LSNs, epochs) as decimal strings: JavaScript numbers lose
  // precision above 2^53.
  const definition = protoLoader.loadSync(files, {
    includeDirs: [dir],
    keepCase: true,
    longs: String,
    enums: String,
    defaults: true,
  });
  return grpc.loadPackageDefinition(definition).squall.v1;
}

function unary(client, method, request) {
  return new Promise((resolve, reject) => {
    client[method](request, { deadline: Date.now() + 30000 }, (err, reply) =>
      err ? reject(err) : resolve(reply),
    );
  });
}

function readAll(subscriber, request) {
  return new Promise((resolve, reject) => {
    const events = [];
    let largest = 0;
    const call = subscriber.Subscribe(request, { deadline: Date.now() + 60000 });
    call.on("data", (response) => {
      largest = Math.max(largest, response.events.reduce((n, e) => n + e.payload.length, 0));
      events.push(...response.events);
    });
    call.on("error", reject);
    call.on("end", () => resolve({ events, largest }));
  });
}

async function main() {
  const a = args();
  const v1 = load(a.protos);
  const credentials = grpc.credentials.createInsecure();
  const topics = new v1.TopicManager(a.gateway, credentials);
  const publisher = new v1.Publisher(a.gateway, credentials);
  const subscriber = new v1.Subscriber(a.gateway, credentials);
  const admin = new v1.ClusterAdmin(a.gateway, credentials);
  const from = (offset) => ({
    topic: a.topic,
    start: "START_POSITION_OFFSET",
    offset: String(offset),
    follow: false,
    max_batch_bytes: a["ask-bytes"] ? Number(a["ask-bytes"]) : 0,
  });

  if (a["ask-bytes"]) {
    await readAll(subscriber, from(0)); // rejects with RESOURCE_EXHAUSTED
    return;
  }
  await unary(topics, "CreateTopic", { name: a.topic });
  const small = [1, 2, 3].map((i) => ({ payload: Buffer.from(`hello ${i}`), sequence: String(i) }));
  const first = await unary(publisher, "Publish", {
    topic: a.topic,
    publisher_id: "node-client",
    events: small,
  });
  // The same publisher id and sequences again: deduplicated, nothing new stored.
  const again = await unary(publisher, "Publish", {
    topic: a.topic,
    publisher_id: "node-client",
    events: small,
  });
  const big = [];
  for (let i = 0; i < 5; i++) big.push({ payload: Buffer.alloc(1000000, 65 + i) });
  const bigReceipts = await unary(publisher, "Publish", { topic: a.topic, events: big });
  const smallRead = await readAll(subscriber, from(0));
  const bigRead = await readAll(subscriber, from(3));
  const status = await unary(admin, "GetClusterStatus", {});
  console.log(
    JSON.stringify({
      offsets: first.receipts.map((r) => r.offset),
      epoch: first.receipts[0].epoch,
      duplicates: again.receipts.map((r) => r.duplicate),
      big_offsets: bigReceipts.receipts.map((r) => r.offset),
      payloads: smallRead.events.slice(0, 3).map((e) => e.payload.toString()),
      read_offsets: bigRead.events.map((e) => e.offset),
      big_sizes: bigRead.events.map((e) => e.payload.length),
      big_first_bytes: bigRead.events.map((e) => e.payload[0]),
      largest_response_payload_bytes: bigRead.largest,
      master_id: status.master_id,
      status_epoch: status.epoch,
    }),
  );
}

main().then(
  () => process.exit(0),
  (err) => {
    console.error(`node client: ${err.code !== undefined ? `code ${err.code}: ` : ""}${err.message}`);
    process.exit(2);
  },
);
