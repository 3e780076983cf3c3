// Package audit defines the broker's audit trail: the Event every decision
// ends in, the actions, decisions and refusal codes it names, the request id
// carried in a context, Log, which writes events as JSON lines, and the
// Recorder, which completes an event (Pending, as a request learns it),
// writes it and counts it through an Observer. It decides nothing and
// imports no other tokenbroker package.
//
// Every decision ends in exactly one Event handed to the broker's Auditor:
// a kubeconfig issued or refused (ActionIssue), a lease revoked or a
// revocation refused (ActionRevoke), a certificate enrolled or renewed or
// refused (ActionEnroll, ActionRenew). The decision is DecisionAllow,
// DecisionDeny (the policy or the request said no) or DecisionError (the
// API server or the CA failed). An event names the caller (identity,
// certificate fingerprint, the transport's request id from WithRequestID)
// and what was handed out (lease id, the token's jti, the certificate's
// serial), never a token, a join token, a kubeconfig or a key. Log
// writes events as JSON lines; the composition root points it at stdout,
// stderr or a file.
package audit
