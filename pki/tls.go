package pki

import (
	"crypto/tls"
	"crypto/x509"
	"time"
)

// ServerTLSConfig is the mTLS server profile, the only server TLS settings in
// tokenbroker: TLS 1.3 only, a client certificate is required and verified
// against clientCAs (for client authentication) before any handler runs, and
// the server certificate comes from certs on every handshake, so rotating the
// files rotates the certificate without a restart.
//
// A lease certificate fails the handshake (RefuseLeaseCertificate), although
// it chains to clientCAs when the signing CA is in the bundle: it is good at
// the lease gateway only, and names no peer that the listener's caps per
// identity could count.
//
// Otherwise the profile checks the chain, not the peer's identity: the caller
// maps the verified leaf to a cluster with IdentityFromCert. NextProtos is
// left empty so that net/http can fill in its own ("h2", "http/1.1"). certs
// must not be nil.
func ServerTLSConfig(certs *CertReloader, clientCAs *x509.CertPool) *tls.Config {
	return &tls.Config{
		MinVersion:       tls.VersionTLS13,
		MaxVersion:       tls.VersionTLS13,
		ClientAuth:       tls.RequireAndVerifyClientCert,
		ClientCAs:        clientCAs,
		GetCertificate:   certs.GetCertificate,
		VerifyConnection: RefuseLeaseCertificate,
	}
}

// LeaseCertificateError is the refusal of a lease certificate by a listener
// other than the lease gateway's (RefuseLeaseCertificate). Certificate is the
// refused leaf, whose subject names the lease and its peer, for the log.
type LeaseCertificateError struct {
	Certificate *x509.Certificate
}

func (e *LeaseCertificateError) Error() string {
	return "tls: a lease certificate is good at the lease gateway only, not at the broker's API"
}

// RefuseLeaseCertificate is the API profile's tls.Config.VerifyConnection:
// it fails the handshake, with a *LeaseCertificateError, of a client whose
// leaf is a lease certificate (IsLeaseCertificate). crypto/tls answers the
// client with a bad_certificate alert, which a TLS 1.3 client reads on its
// first read.
func RefuseLeaseCertificate(cs tls.ConnectionState) error {
	if len(cs.PeerCertificates) > 0 && IsLeaseCertificate(cs.PeerCertificates[0]) {
		return &LeaseCertificateError{Certificate: cs.PeerCertificates[0]}
	}
	return nil
}

// ClientTLSConfig is the mTLS client profile: TLS 1.3 only, the server must
// chain to rootCAs, and the client certificate comes from cert on every
// handshake. cert may be nil for a client with no certificate yet (enrollment
// with a join token). rootCAs should not be nil: nil means the system roots,
// which are never right for tokenbroker peers. The caller sets ServerName when
// it differs from the dialled host.
func ClientTLSConfig(rootCAs *x509.CertPool, cert *CertReloader) *tls.Config {
	cfg := &tls.Config{
		MinVersion: tls.VersionTLS13,
		MaxVersion: tls.VersionTLS13,
		RootCAs:    rootCAs,
	}
	if cert != nil {
		cfg.GetClientCertificate = cert.GetClientCertificate
	}
	return cfg
}

// ServerTLSConfigReloading is ServerTLSConfig whose client CA pool follows
// clientCAs, so that a CA added to or removed from the trust bundle file
// (during a CA rotation) is trusted or distrusted without a restart. Each
// handshake gets, through GetConfigForClient, a config with the pool in
// force; everything else is the ServerTLSConfig profile (TLS 1.3 only,
// RequireAndVerifyClientCert, lease certificates refused).
//
// Session tickets are off: a resumed TLS 1.3 session is not verified against
// the client CA pool again, so it would let a client whose CA was just removed
// keep coming back. Clients keep connections alive instead.
func ServerTLSConfigReloading(certs *CertReloader, clientCAs *PoolReloader) *tls.Config {
	cfg := ServerTLSConfig(certs, clientCAs.Pool())
	cfg.SessionTicketsDisabled = true
	cfg.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) {
		c := ServerTLSConfig(certs, clientCAs.Pool())
		c.SessionTicketsDisabled = true
		return c, nil
	}
	return cfg
}

// EnrollmentTLSConfig is the profile of the enrollment listener, where a
// cluster without a certificate yet presents a join token (POST
// /v1/certificates) or fetches the trust bundle: TLS 1.3 only, the server
// certificate from certs, and no client certificate requested. Authentication
// on this listener is the handler's job. certs must not be nil.
func EnrollmentTLSConfig(certs *CertReloader) *tls.Config {
	return &tls.Config{
		MinVersion:     tls.VersionTLS13,
		MaxVersion:     tls.VersionTLS13,
		ClientAuth:     tls.NoClientCert,
		GetCertificate: certs.GetCertificate,
	}
}

// GatewayTLSConfig is the profile of the lease gateway's listener: TLS 1.3
// only, the server certificate from certs, and a client certificate
// required that chains to roots() (the signing CAs, pinned: nothing else
// verifies a lease) at now() and that VerifyLeaseCertificate accepts.
// The chain is verified by crypto/tls itself, against roots() as they are
// at each handshake (GetConfigForClient), so that the connection state
// carries the verified chains: the gateway checks every certificate of
// them against the deny list, the signing CA's included. Session tickets
// are off, so that every connection is verified afresh.
func GatewayTLSConfig(certs *CertReloader, roots func() *x509.CertPool, now func() time.Time) *tls.Config {
	cfg := &tls.Config{
		MinVersion:             tls.VersionTLS13,
		MaxVersion:             tls.VersionTLS13,
		ClientAuth:             tls.RequireAndVerifyClientCert,
		GetCertificate:         certs.GetCertificate,
		SessionTicketsDisabled: true,
		NextProtos:             []string{"h2", "http/1.1"},
		Time:                   now,
		VerifyConnection: func(cs tls.ConnectionState) error {
			_, err := VerifyLeaseCertificate(cs.PeerCertificates, roots(), now())
			return err
		},
	}
	base := cfg.Clone()
	cfg.GetConfigForClient = func(*tls.ClientHelloInfo) (*tls.Config, error) {
		c := base.Clone()
		// No roots verify nothing (a nil pool would be the system's).
		if c.ClientCAs = roots(); c.ClientCAs == nil {
			c.ClientCAs = x509.NewCertPool()
		}
		return c, nil
	}
	return cfg
}
