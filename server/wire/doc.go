// Package wire reads what a client sends the broker's API over HTTP,
// before any handler looks at it: a JSON body decoded strictly (one object,
// no unknown, duplicate or trailing members) within a size bound, a key
// set upload, and the Accept header negotiated (RFC 9110). Every refusal is
// a *problem.Error the server answers as problem+json.
package wire
