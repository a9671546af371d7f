#!/usr/bin/env node
// A Node.js client of the SCD consumer, as a user of another language writes it: @grpc/grpc-js and
// @grpc/proto-loader, the .proto files loaded at run time from protos/ (no generated code).
//
//   node scd_client.js HOST:PORT [REQUEST_JSON]
//
// Calls grpc.health.v1.Health/Check (overall and scd.v1.ConsumerService),
// scd.v1.ConsumerService/Describe, and scd.v1.ConsumerService/Generate once per transfer mode in
// SCD_NODE_MODES (default "oracle,raw") with REQUEST_JSON as the GenerateRequest (snake_case
// field names; default: a short text context and question, 8 new tokens). Prints one JSON object:
// {"health": {...}, "describe": {...}, "generate": {mode: {"ids", "text", "stats", "messages"}}}.
//
// Loader options, and why:
//   keepCase: true   field names as in the .proto (snake_case), the same as every other language
//   longs: String    uint64 fields (bytes_received, raw_kv_bytes, seed) arrive as decimal strings;
//                    JavaScript numbers lose precision above 2^53 (use BigInt(value) to compute)
//   enums: String    enum fields by name ("FINISH_REASON_STOP"), not number
//   defaults: true   unset scalar fields present with their zero value, as proto3 defines them
//   oneofs: true     a virtual field names the set member of each oneof: GenerateResponse.kind is
//                    "token" for every TokenDelta, "commit" for the one VerifyCommit of a request
//                    with verify = "VERIFY_POLICY_PROVISIONAL", and "stats" for the final GenerateStats
"use strict";

const path = require("node:path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTOS = process.env.SCD_PROTOS_DIR || path.resolve(__dirname, "..", "..", "protos");
const LOADER_OPTIONS = { keepCase: true, longs: String, enums: String, defaults: true, oneofs: true };

function load() {
  const definition = protoLoader.loadSync(
    ["scd/v1/consumer.proto", path.join(__dirname, "health.proto")],
    { ...LOADER_OPTIONS, includeDirs: [PROTOS] },
  );
  return grpc.loadPackageDefinition(definition);
}

function unary(client, method, request, timeoutS = 30) {
  return new Promise((resolve, reject) => {
    client[method](request, { deadline: Date.now() + timeoutS * 1000 }, (err, reply) => (err ? reject(err) : resolve(reply)));
  });
}

// Generate streams TokenDelta messages (kind "token") and then one GenerateStats (kind "stats").
// With verify = "VERIFY_POLICY_PROVISIONAL" the tokens before the one VerifyCommit (kind "commit")
// are drafts: keep the first accepted_tokens of them, append the commit's ids, take its text.
function generate(client, request, timeoutS = 120) {
  return new Promise((resolve, reject) => {
    const answer = { ids: [], text: "", stats: null, messages: 0 };
    const call = client.Generate(request, { deadline: Date.now() + timeoutS * 1000 });
    call.on("data", (msg) => {
      answer.messages += 1;
      if (msg.kind === "token") {
        answer.ids.push(...msg.token.ids);
        answer.text += msg.token.text;
      } else if (msg.kind === "commit") {
        answer.provisional_ids = answer.ids;
        answer.ids = answer.ids.slice(0, msg.commit.accepted_tokens).concat(msg.commit.ids);
        answer.text = msg.commit.text;
      } else if (msg.kind === "stats") {
        answer.stats = msg.stats;
      }
    });
    call.on("error", reject);
    call.on("end", () => resolve(answer));
  });
}

async function main() {
  const [address, requestJson] = process.argv.slice(2);
  if (!address) {
    console.error("usage: node scd_client.js HOST:PORT [REQUEST_JSON]");
    process.exit(2);
  }
  const base = requestJson ? JSON.parse(requestJson) : {
    context: { text: "The producer reads a long context and the consumer writes the answer." },
    question: { text: " Who writes the answer?" },
    max_new_tokens: 8,
  };
  const modes = (process.env.SCD_NODE_MODES || "oracle,raw").split(",");
  const pkg = load();
  const credentials = grpc.credentials.createInsecure();
  const health = new pkg.grpc.health.v1.Health(address, credentials);
  const consumer = new pkg.scd.v1.ConsumerService(address, credentials);
  const result = { health: {}, describe: null, generate: {} };
  try {
    for (const service of ["", "scd.v1.ConsumerService"]) {
      result.health[service || "(server)"] = (await unary(health, "Check", { service })).status;
    }
    const described = await unary(consumer, "Describe", {});
    result.describe = {
      api_version: described.api_version,
      model: described.model,
      codecs: described.codecs.map((c) => c.name),
      limits: described.limits,
    };
    for (const mode of modes) {
      const request = { ...base, request_id: `node-${mode}`, transfer: { name: mode, options: {} } };
      result.generate[mode] = await generate(consumer, request);
    }
  } finally {
    health.close();
    consumer.close();
  }
  process.stdout.write(JSON.stringify(result) + "\n");
}

main().catch((err) => {
  console.error(`scd_client: ${err.code !== undefined ? grpc.status[err.code] + ": " : ""}${err.details || err.message}`);
  process.exit(1);
});
