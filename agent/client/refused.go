package client

import (
	"crypto/tls"
	"errors"
	"net"
	"reflect"
)

// ErrCertificateRefused is wrapped by a request's error when the broker
// refused the client certificate in the TLS handshake with a fatal alert
// (bad_certificate, unknown_ca, certificate_revoked, certificate_expired,
// certificate_required, …): it does not accept this identity, as a 401
// would say. Not retryable.
//
// It is reported only when the broker had already proved its own
// certificate on that connection (a verified handshake, or a kept-alive
// connection): an alert before that is plaintext in the handshake and
// anyone on the path can forge it, so it stays a transport error.
var ErrCertificateRefused = errors.New("the broker refused the client certificate in the TLS handshake")

// refusalAlerts are the TLS alerts (RFC 8446 section 6.2) by which a
// server refuses the client's certificate.
var refusalAlerts = map[uint8]bool{
	42:  true, // bad_certificate
	43:  true, // unsupported_certificate
	44:  true, // certificate_revoked
	45:  true, // certificate_expired
	46:  true, // certificate_unknown
	48:  true, // unknown_ca
	49:  true, // access_denied
	116: true, // certificate_required
}

// remoteRefusalAlert reports whether err holds a fatal alert that the
// peer sent refusing our certificate. crypto/tls reports a received alert
// as a *net.OpError with Op "remote error" around its unexported alert
// type (a uint8; tls.AlertError is what it reports for alerts it sends,
// and for QUIC), so the code is read by reflection rather than from the
// message text.
func remoteRefusalAlert(err error) bool {
	for err != nil {
		var oe *net.OpError
		if !errors.As(err, &oe) {
			return false
		}
		if oe.Op == "remote error" {
			if code, ok := alertCode(oe.Err); ok {
				return refusalAlerts[code]
			}
		}
		err = oe.Err
	}
	return false
}

func alertCode(err error) (uint8, bool) {
	if ae, ok := errors.AsType[tls.AlertError](err); ok {
		return uint8(ae), true
	}
	if err == nil {
		return 0, false
	}
	v := reflect.ValueOf(err)
	if t := v.Type(); t.Kind() == reflect.Uint8 && t.PkgPath() == "crypto/tls" {
		return uint8(v.Uint()), true
	}
	return 0, false
}
