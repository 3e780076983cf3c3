package broker

import (
	"context"

	"go.uber.org/zap"

	apiv1 "github.com/tokenbroker/tokenbroker/api/v1"
	"github.com/tokenbroker/tokenbroker/broker/audit"
	"github.com/tokenbroker/tokenbroker/broker/kubeconfig"
	"github.com/tokenbroker/tokenbroker/broker/policy"
)

// ExecKubeconfig authorizes req for caller as IssueKubeconfig does, but
// issues nothing: it returns a kubeconfig whose user runs the exec
// credential plugin ("tokenbroker credential", found on the PATH) with
// req against brokerURL, the URL the caller reached this broker by. The
// plugin reads the caller's identity from $TOKENBROKER_IDENTITY_DIR, as
// the broker cannot know where the caller keeps it. Asking now tells the
// caller at once whether the policy grants the request, rather than at its
// first kubectl. Every call ends in one audit event (ActionExecKubeconfig).
func (b *Broker) ExecKubeconfig(ctx context.Context, c Caller, req apiv1.KubeconfigRequest, brokerURL string) ([]byte, error) {
	a := &audit.Pending{Event: audit.Event{
		Action:         audit.ActionExecKubeconfig,
		Identity:       c.Identity,
		CertSHA256:     c.CertSHA256,
		Namespace:      req.Namespace,
		ServiceAccount: req.ServiceAccount,
		Credential:     policy.OrDefault(req.Credential, apiv1.CredentialToken),
		RequestedTTL:   req.TTL,
	}}
	kc, outcome, err := b.execKubeconfig(c, req, brokerURL, a)
	b.concludeOutcome(ctx, a, outcome, err)
	return kc, err
}

func (b *Broker) execKubeconfig(c Caller, req apiv1.KubeconfigRequest, brokerURL string, a *audit.Pending) ([]byte, string, error) {
	log := b.cfg.Logger.With(zap.String("identity", c.Identity), zap.String("namespace", req.Namespace), zap.String("service_account", req.ServiceAccount))
	dec, outcome, err := b.decide(c, req, a, log)
	if err != nil {
		return nil, outcome, err
	}
	if err := b.admission().Issuance(dec.policy, c.Identity, dec.Peer, a); err != nil {
		return nil, outcomeLimited, err
	}
	kc, err := kubeconfig.Exec(dec.policy.Cluster, req, brokerURL)
	if err != nil {
		return nil, outcomeError, err
	}
	log.Info("decision", zap.Bool("allowed", true), zap.String("peer", dec.Peer), zap.String("action", audit.ActionExecKubeconfig))
	return kc, outcomeGranted, nil
}
