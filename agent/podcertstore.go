package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"go.uber.org/zap"
	"k8s.io/utils/clock"

	"github.com/tokenbroker/tokenbroker/pki"
)

// podCertificateReload is how often the agent reads its pod certificate
// again. The kubelet replaces it well before it expires (at its refresh
// hint, or half its lifetime, which is at least an hour).
const podCertificateReload = time.Minute

// podCertificateStore is the agent's identity when it is its own Pod's
// certificate (identity.podCertificate): the kubelet's podCertificate
// volume, tls.crt and tls.key, beside ca.crt. The kubelet writes and
// rotates it; the agent only reads it, so there is nothing to save.
type podCertificateStore struct{ dir IdentityDir }

var _ identityStore = podCertificateStore{}

func (s podCertificateStore) String() string { return "podCertificate:" + string(s.dir) }

// load reads the volume. Its certificate must be a pod certificate: a
// cluster's client certificate there is a mistake of the Pod's spec.
func (s podCertificateStore) load(ctx context.Context) (*identity, error) {
	id, err := dirStore{dir: s.dir, workload: true}.load(ctx)
	if err != nil {
		return nil, err
	}
	if !pki.IsWorkloadCertificate(id.leaf()) {
		return nil, fmt.Errorf("identity in %s: %s is not a pod certificate (a workload identity): the directory must be the Pod's podCertificate volume; %w",
			s.dir, CertFile, pki.ErrInvalidIdentity)
	}
	if id.clusterCA != nil {
		return nil, fmt.Errorf("identity in %s: a pod certificate identity holds no cluster CA; %w", s.dir, pki.ErrInvalidIdentity)
	}
	return id, nil
}

func (podCertificateStore) save(context.Context, *identity) error {
	return errors.New("a pod certificate identity is written by the kubelet, never by the agent")
}

// podCertificateReloader keeps the identity in service the one the kubelet
// last wrote: it reads the volume every podCertificateReload and, when the
// certificate changed, swaps it in and closes idle broker connections, so
// that the next requests present it. A read that fails keeps the identity
// in service (the kubelet may be half-way through its swap, which is
// atomic for a reader of the whole volume only).
type podCertificateReloader struct {
	store     identityStore
	holder    *identityHolder
	clock     clock.Clock
	log       *zap.Logger
	onChanged func()
}

func (r *podCertificateReloader) run(ctx context.Context) { runSteps(ctx, r.clock, r.step) }

func (r *podCertificateReloader) step(ctx context.Context) time.Time {
	next := r.clock.Now().Add(podCertificateReload)
	id, err := r.store.load(ctx)
	if err != nil {
		r.log.Warn("cannot read the pod certificate again; the one in service stays", zap.String("store", r.store.String()), zap.Error(err))
		return next
	}
	cur := r.holder.get()
	if cur != nil && bytes.Equal(cur.certPEM, id.certPEM) && bytes.Equal(cur.bundlePEM, id.bundlePEM) {
		return next
	}
	r.holder.set(id)
	r.log.Info("pod certificate reloaded", zap.String("identity", id.spiffeID),
		zap.String("serial", id.leaf().SerialNumber.Text(16)), zap.Time("not_after", id.leaf().NotAfter))
	if r.onChanged != nil {
		r.onChanged()
	}
	return next
}
