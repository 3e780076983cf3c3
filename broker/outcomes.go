package broker

import "github.com/tokenbroker/tokenbroker/broker/problem"

// Outcomes of an issuance, as counted in metrics.
const (
	outcomeGranted       = "granted"
	outcomeDenied        = "denied"
	outcomeInvalid       = "invalid"
	outcomeUnprocessable = "unprocessable"
	outcomeNotFound      = "not_found"
	outcomeUnavailable   = "unavailable"
	outcomeError         = "error"
	outcomeLimited       = "limited"
)

// issueOutcomes label an issuance that failed, by the kind of its error.
var issueOutcomes = map[problem.Kind]string{
	problem.KindForbidden:     outcomeDenied,
	problem.KindInvalid:       outcomeInvalid,
	problem.KindUnprocessable: outcomeUnprocessable,
	problem.KindNotFound:      outcomeNotFound,
	problem.KindUnavailable:   outcomeUnavailable,
	// A signer that did not answer in time: the cluster is unavailable
	// for this request.
	problem.KindTimeout:         outcomeUnavailable,
	problem.KindTooManyRequests: outcomeLimited,
}

func outcomeFor(err error) string { return problem.Label(err, issueOutcomes, outcomeError) }
