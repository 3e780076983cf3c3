// Package leasecert is the issuer of gateway leases: a client certificate
// from the broker's CA for one lease (pki.SignLease), good at the lease
// gateway only. It makes no call to the API server: the gateway forwards
// the lease's requests with a credential of its own, so that issuing a
// gateway lease is the lease Secret's write and a local signature.
package leasecert

import (
	"context"
	"crypto"
	"errors"
	"fmt"
	"time"

	"github.com/tokenbroker/tokenbroker/issuers"
	"github.com/tokenbroker/tokenbroker/pki"
)

// Signer signs lease certificates: *pki.CAReloader (the signing CA, as
// reloaded) or *pki.CA.
type Signer interface {
	SignLease(pub crypto.PublicKey, n pki.LeaseName, notAfter time.Time) (*pki.KeyPair, error)
	NewLeaseKey() (crypto.PublicKey, []byte, error)
}

// Issuer issues lease certificates with Signer. Now is its clock (nil:
// time.Now).
type Issuer struct {
	Signer Signer
	Now    func() time.Time
}

// Kind is a client certificate: that is what the kubeconfig carries.
func (*Issuer) Kind() string { return issuers.KindClientCertificate }

// Limits: no minimum of its own (the lease's applies), and revocation is
// the lease's, which the gateway enforces on every request and every open
// connection.
func (*Issuer) Limits() issuers.Limits {
	return issuers.Limits{Revocation: issuers.RevokedByLease}
}

// Issue signs a lease certificate for req.Lease, valid for req.TTL. With
// req.CSR (the caller's, parsed and checked by the broker with
// pki.ParseLeaseCSRPEM) the certificate is for its key and no key is
// returned; without, a new key is made and returned once in KeyPEM.
func (i *Issuer) Issue(_ context.Context, req issuers.Request) (issuers.Credential, error) {
	if req.Lease.Name == "" || req.Lease.UID == "" || req.LeaseID == "" {
		return issuers.Credential{}, errors.New("leasecert: a lease object is required")
	}
	var (
		pub    crypto.PublicKey
		keyPEM []byte
	)
	if req.CSR != nil {
		pub = req.CSR.PublicKey
	} else {
		var err error
		if pub, keyPEM, err = i.Signer.NewLeaseKey(); err != nil {
			return issuers.Credential{}, fmt.Errorf("leasecert: make key: %w", err)
		}
	}
	now := time.Now
	if i.Now != nil {
		now = i.Now
	}
	kp, err := i.Signer.SignLease(pub, pki.LeaseName{
		Namespace: req.Namespace, ServiceAccount: req.ServiceAccount,
		ID: req.LeaseID, UID: string(req.Lease.UID), Peer: req.Peer,
	}, now().Add(req.TTL))
	if err != nil {
		return issuers.Credential{}, err
	}
	return issuers.Credential{CertificatePEM: kp.CertPEM, KeyPEM: keyPEM, Leaf: kp.Cert, NotBefore: kp.Cert.NotBefore, ExpiresAt: kp.Cert.NotAfter}, nil
}
